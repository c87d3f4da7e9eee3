"""The documentation site: every guide's Python block runs on its own, and the index reaches
every guide and every public name."""

import importlib
import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GUIDES = sorted((DOCS / "guides").glob("*.md"))
MODULES = ("mpjax", "mpjax.flax", "mpjax.fp8", "mpjax.export", "mpjax.checkpoint")


def python_blocks(path: pathlib.Path) -> list[str]:
    # ```python fences run; peers' code is shown in {code-block} directives, which do not.
    return re.findall(r"^ *```python\n(.*?)^ *```", path.read_text(), flags=re.S | re.M)


def dedent(block: str) -> str:
    lines = block.splitlines()
    indent = min((len(s) - len(s.lstrip()) for s in lines if s.strip()), default=0)
    return "\n".join(s[indent:] for s in lines) + "\n"


BLOCKS = [
    pytest.param(path, i, id=f"{path.stem}-{i}")
    for path in [DOCS / "index.md", *GUIDES]
    for i in range(len(python_blocks(path)))
]


@pytest.mark.parametrize("path, index", BLOCKS)
def test_python_block_runs_on_its_own(path, index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    block = dedent(python_blocks(path)[index])
    exec(compile(block, f"{path.relative_to(ROOT)} block {index}", "exec"), {"__name__": "doc"})


def test_every_guide_is_in_the_index():
    index = (DOCS / "index.md").read_text()
    toctree = re.search(r"```\{toctree\}\n(.*?)```", index, flags=re.S).group(1)
    listed = {line.strip() for line in toctree.splitlines() if line.startswith("guides/")}
    assert listed == {f"guides/{g.stem}" for g in GUIDES}
    for guide in GUIDES:
        assert guide.read_text().startswith("# "), f"{guide.name} needs a title"


def test_every_public_name_is_in_the_api_reference():
    api = (DOCS / "api.rst").read_text()
    missing = []
    for name in MODULES:
        module = importlib.import_module(name)
        section = api if name == "mpjax" else api[api.index(f"\n{name}\n") :]
        section = section.split("\nmpjax.")[0] if name == "mpjax" else section
        for public in module.__all__:
            listed = rf"^(   |\.\. data:: ){re.escape(public)}$"
            if not re.search(listed, section, flags=re.M):
                missing.append(f"{name}.{public}")
    assert not missing, f"not in docs/api.rst: {missing}"


def public_objects():
    """(qualified name, object) for every public name and every public method or property of
    a public class, as the API reference lists them."""
    import inspect

    for name in MODULES:
        module = importlib.import_module(name)
        for public in module.__all__:
            obj = getattr(module, public)
            if not (inspect.isclass(obj) or callable(obj)):
                continue  # LEVELS, F32_OPS: documented in the module and guides
            yield f"{name}.{public}", obj
            if not inspect.isclass(obj):
                continue
            for attr, member in vars(obj).items():
                if attr.startswith("_") or attr in getattr(obj, "_fields", ()):
                    continue  # NamedTuple fields are documented in the class's Attributes
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                code = member.fget if isinstance(member, property) else member
                if inspect.isfunction(code) and code.__module__.startswith("mpjax"):
                    # (not what Flax's struct.dataclass generates, such as TrainState.replace)
                    yield f"{name}.{public}.{attr}", member


def test_every_public_name_and_method_has_a_runnable_example():
    # The examples run as doctests (pytest --doctest-modules over mpjax/); here: none lacks one.
    missing = [q for q, obj in public_objects() if ">>>" not in (obj.__doc__ or "")]
    assert not missing, f"docstrings without an example: {missing}"


def test_index_quickstart_is_the_readmes():
    readme = (ROOT / "README.md").read_text()
    assert python_blocks(DOCS / "index.md")[0] in readme


def test_audit_table_in_the_guide_is_the_quickstarts_real_audit():
    import mpjax

    if jax.default_backend() != "cpu":
        pytest.skip("the guide shows the CPU audit")
    namespace: dict = {}
    exec(compile(python_blocks(DOCS / "index.md")[0], "quickstart.py", "exec"), namespace)
    report = mpjax.audit(
        namespace["train_step"],
        namespace["params"],
        namespace["opt_state"],
        namespace["x"],
        namespace["y"],
    )
    guide = (DOCS / "guides" / "audit.md").read_text()
    shown = re.search(r"```text\n>>> print\(mpjax.audit.*?\n(.*?)```", guide, flags=re.S).group(1)
    assert shown.strip() == str(report).strip()


def autosummary_names():
    """(module, name) of every entry of api.rst's autosummary lists."""
    api = (DOCS / "api.rst").read_text()
    module, inside = "mpjax", False
    for line in api.splitlines():
        if line.startswith(".. currentmodule:: "):
            module = line.split(":: ", 1)[1].strip()
        inside = line.startswith(".. autosummary::") or (inside and (not line or line[0] == " "))
        if inside and re.fullmatch(r"   [A-Za-z_][\w.]*", line):
            yield module, line.strip()


def test_no_api_page_shows_a_builtin_docstring():
    # autosummary renders an object's __doc__: for a tuple, frozenset or type union that is
    # Python's own text ("Built-in immutable sequence.", "frozenset() -> empty frozenset
    # object"), and a union's page names private module paths. Such names are documented
    # with `.. data::` and their own text instead.
    import inspect

    shown, names = [], list(autosummary_names())
    assert len(names) > 60, names  # the parse found the lists
    for module, name in names:
        obj = getattr(importlib.import_module(module), name)
        doc = inspect.getdoc(obj) or ""
        builtin = type(obj).__module__ in ("builtins", "types") and not callable(obj)
        if builtin or not doc or doc == inspect.getdoc(type(obj)) or "._src." in doc:
            shown.append(f"{module}.{name}")
    assert not shown, f"API pages that would show a builtin docstring: {shown}"


def test_api_reference_examples_run():
    import doctest

    api = (DOCS / "api.rst").read_text()
    test = doctest.DocTestParser().get_doctest(api, {}, "api.rst", str(DOCS / "api.rst"), 0)
    assert len(test.examples) >= 10  # LEVELS, F32_OPS, LOWER_OPS and LossScale have examples
    for block in re.split(r"\n\.\. data:: ", api)[1:]:
        assert ">>>" in block.split("\n\n.. ", 1)[0], block.split("\n", 1)[0]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
