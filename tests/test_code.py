"""The code's shape, checked from its source: mpjax's modules import each other without a
circle (type-only imports included), no module is over 800 lines and no function over 60,
docstring aside."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mpjax"


def _where(module: str) -> str:
    """The dotted name of the mpjax._src module `module`, in whichever subpackage."""
    found = [n for n in _modules() if n.startswith("mpjax._src.") and n.endswith(f".{module}")]
    assert len(found) == 1, (module, found)
    return found[0]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The mpjax modules `path` imports anywhere in it (a function's lazy import and one
    under ``TYPE_CHECKING`` count: each is a dependency a reader has to follow)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpjax"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, or None."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_of_mpjax_imports_one_that_imports_it_back():
    modules = _modules()
    assert (
        "mpjax._src.interpreter.autocast" in modules
        and "mpjax._src.interpreter.autocast_uses" in modules
    )
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert (
        "mpjax._src.interpreter.rules" in graph["mpjax._src.interpreter.autocast"]
    )  # the reading works
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"


def _long_functions(limit: int) -> list[tuple[int, str]]:
    """(lines, where) of each function over `limit` lines, its docstring not counted (nested
    functions count in the function that holds them, as a reader meets them)."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                lines -= (first.end_lineno or first.lineno) - first.lineno + 1
            if lines > limit:
                found.append((lines, f"{name}.{node.name}"))
    return sorted(found, reverse=True)


def test_no_function_is_over_60_lines_docstring_aside():
    assert _long_functions(40), "the measure finds long functions"  # the reading works
    assert not _long_functions(60), _long_functions(60)


def test_no_module_is_over_800_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert max(sizes.values()) > 400  # the reading works
    assert not {n: k for n, k in sizes.items() if k > 800}


def _function(module: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(_modules()[module].read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{module}.{name}"
    return found[0]


def test_the_default_rule_is_a_page_and_names_no_primitive():
    """The default first-order rule decides through rules.py and treats no primitive by name:
    a primitive that needs more has a rule of its own, registered beside it."""
    from mpjax._src.interpreter import ops

    default = ("_primitive_rule", "_apply", "_decide", "_keep", "_cast_and_bind")
    for name in default:
        fn = _function("mpjax._src.interpreter.first_order", name)
        lines = (fn.end_lineno or fn.lineno) - fn.lineno + 1
        doc = fn.body[0]
        if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            lines -= (doc.end_lineno or doc.lineno) - doc.lineno + 1
        assert lines <= 40, (name, lines)
        strings = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant)}
        named = {s for s in strings if isinstance(s, str) and s in ops.PRIMITIVES}
        # An add of a matmul's result and a smaller value is a bias add, as torch's promote
        # list makes it part of the matmul (rules.target_dtype's bias_add).
        assert named <= {"add"}, (name, named)
    registered = _function("mpjax._src.interpreter.first_order", "_gather_rule")
    assert registered.decorator_list, "the special cases are registered rules"


def test_the_core_keeps_no_hidden_state():
    """The interpreter core reads what it needs from its arguments (autocast.Context): no
    context variable, so a rule's behaviour shows in its signature."""
    core = ["interpret", "ops", "rules", "first_order", "autocast", "autocast_uses", "values"]
    modules = _modules()
    for name in core:
        source = modules[f"mpjax._src.interpreter.{name}"].read_text()
        assert "ContextVar" not in source and "contextvars" not in source, name
    assert (
        "ContextVar" in modules["mpjax._src.interpreter.autocast_api"].read_text()
    )  # the reading works


def _level_comparisons(source: str) -> list[int]:
    """Lines of `source` that compare something with a level's name ("O0".."O3")."""
    from mpjax._src.levels import LEVELS

    def names_a_level(node: ast.AST) -> bool:
        return any(
            isinstance(n, ast.Constant) and n.value in LEVELS
            for n in ast.walk(node)
            if not isinstance(n, ast.JoinedStr)
        )

    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Compare) and any(map(names_a_level, [node.left, *node.comparators]))
    ]


def test_no_module_but_the_levels_home_compares_a_level():
    """What a level means lives in levels.py (one row per level): every other module reads
    the row's decisions by name, so that changing "O2 but not O1" is changing one cell."""
    assert _level_comparisons('a = 1\nif p.level in ("O2", "O3"):\n    pass') == [2]
    assert _level_comparisons('if p.level == "O0" or not p.half:\n    pass') == [1]
    found = {
        name: lines
        for name, path in _modules().items()
        if name != "mpjax._src.levels" and (lines := _level_comparisons(path.read_text()))
    }
    assert not found, found


def test_no_walker_names_a_higher_order_primitive():
    """Each higher-order primitive's names and bodies are written once, in its
    interpret.Layout; the interpreters register their rules by it and read its bodies
    through it (``interpret.SCAN.names``, ``interpret.branches(eqn)``)."""
    from mpjax._src.interpreter import interpret

    names = {n for layout in interpret.LAYOUTS for n in layout.names}
    names |= {k for layout in interpret.LAYOUTS for keys in layout.params.values() for k in keys}
    names -= {"jaxpr"}  # a call's, a remat's and a scan's body: too common a word to read for
    assert {"scan", "while", "cond", "branches", "cond_jaxpr", "custom_vjp_call"} <= names
    walkers = ["autocast", "autocast_uses", "first_order", "values", "islands", "half_grads",
               "rules", "shadow", "fp8", "compare", "nonfinite", "regions",
               "f32_search"]  # fmt: skip
    modules = _modules()
    found = {}
    for name in [_where(w) for w in walkers] + ["mpjax.export", "mpjax.flax"]:
        tree = ast.parse(modules[name].read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
        if named := sorted(s for s in strings if isinstance(s, str) and s in names):
            found[name] = named
    assert not found, found


CORE = ["islands", "autocast", "first_order", "values", "half_grads", "interpret",
        "autocast_uses", "rules"]  # fmt: skip


def test_the_core_is_typed_but_where_jax_is_not():
    """The interpreter core names its types (jc.JaxprEqn, jc.Atom, jc.Value, Step, Results):
    `Any` stays where JAX itself is untyped (an equation's params, a name stack, a
    shard_map's tracing context), at most 120 times over the eight modules."""
    count = {
        name: len(re.findall(r"\bAny\b", _modules()[f"mpjax._src.interpreter.{name}"].read_text()))
        for name in CORE
    }
    assert sum(count.values()) > 20, count  # the reading works
    assert sum(count.values()) <= 120, count


def test_every_evaluation_rule_takes_a_step_and_the_operands():
    """An evaluation rule's signature is (step, invals): a Step carries the context, the
    equation, the values known, the use analysis, the mode and the traceback."""
    import inspect

    from mpjax._src.interpreter import autocast, first_order

    registries = [first_order.RULES, autocast.RULES]
    rules = {r for registry in registries for r in registry._rules.values()}
    rules |= {first_order.RULES._default, autocast.RULES._higher_order}
    assert len(rules) >= 8, rules
    for rule in rules:
        assert list(inspect.signature(rule).parameters) == ["step", "invals"], rule
