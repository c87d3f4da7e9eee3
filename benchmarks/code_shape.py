"""The shape of mpjax's code, counted from its source: the functions that walk a jaxpr's
equations, the lines that decode a scan's or a while loop's operand layout, imports of another
module's underscored names, the longest functions and the module sizes.

    python benchmarks/code_shape.py            # the package beside this folder
    python benchmarks/code_shape.py path/to/mpjax
"""

from __future__ import annotations

import ast
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT = re.compile(r"cond_nconsts|body_nconsts|\bnum_consts\b|\bnum_carry\b")


def _source(text: str, node: ast.AST) -> str:
    return ast.get_source_segment(text, node) or ""


def _walks(text: str, fn: ast.AST) -> bool:
    """Whether `fn` itself (not a function nested in it) loops over a jaxpr's equations."""
    nested = [n for n in ast.walk(fn) if n is not fn and isinstance(n, ast.FunctionDef)]
    inner = {id(x) for n in nested for x in ast.walk(n)}
    return any(
        isinstance(n, ast.For)
        and id(n) not in inner
        and re.search(r"\beqns\b", _source(text, n.iter))
        for n in ast.walk(fn)
    )


def _module_aliases(tree: ast.AST, modules: set[str]) -> dict[str, str]:
    """Local names bound to mpjax modules (``from mpjax._src import rules as r``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpjax"):
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:
                    aliases[a.asname or a.name] = a.name
    return aliases


def main(root: str) -> None:
    files = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")
    )
    base = os.path.dirname(os.path.abspath(root))
    modules = {
        os.path.relpath(f, base)[:-3].replace(os.sep, ".").removesuffix(".__init__") for f in files
    }
    walkers, decoders, underscored, functions, sizes = [], [], [], [], []
    for path in files:
        text = open(path).read()
        name = os.path.relpath(path, base)
        sizes.append((text.count("\n"), name))
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                functions.append(
                    (node.end_lineno - node.lineno + 1, f"{name}:{node.lineno} {node.name}")
                )
                if _walks(text, node):
                    walkers.append(f"{name}:{node.lineno} {node.name}")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpjax"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        underscored.append(f"{name}: from {node.module} import {a.name}")
        aliases = _module_aliases(tree, modules)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                underscored.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
        for i, line in enumerate(text.splitlines(), 1):
            if LAYOUT.search(line) and "p.update(" not in line:
                decoders.append(f"{name}:{i}")
    print(f"functions that walk a jaxpr's equations: {len(walkers)}")
    for w in walkers:
        print(f"  {w}")
    print(f"lines that decode a scan's or while loop's operand layout: {len(decoders)}")
    for d in decoders:
        print(f"  {d}")
    print(f"imports of another module's underscored names: {len(underscored)}")
    for u in underscored:
        print(f"  {u}")
    print("ten longest functions (lines):")
    for n, f in sorted(functions, reverse=True)[:10]:
        print(f"  {n:4d} {f}")
    print("modules over 150 lines:")
    for n, f in sorted(sizes, reverse=True):
        if n > 150:
            print(f"  {n:5d} {f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "mpjax"))
