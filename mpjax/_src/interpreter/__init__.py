"""The autocast interpreter: the interpreter core, the op table, the dtype rule, and
autocast's evaluation and analyses."""
