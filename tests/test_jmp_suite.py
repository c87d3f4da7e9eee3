"""jmp's own test suite, run against mpjax: `import mpjax as jmp` passes what jmp passes.

The test files ship inside the jmp wheel (``jmp/_src/loss_scale_test.py`` and
``jmp/_src/policy_test.py``). Each is copied to a temporary folder, its ``from jmp._src import
... as jmp`` line is rewritten to ``import mpjax as jmp``, and pytest runs it in a fresh
process. The same files, rewritten to ``import jmp``, run against jmp itself as the control,
so both runs use exactly jmp's public API.

Deselection rule: a test is left out only if it uses a name that jmp does not export
(not in ``jmp.__all__``); such a test checks jmp's internals, which mpjax does not copy.
``DESELECTED`` lists each one with its reason, and the test below checks that the rule
picks exactly those.
"""

import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
JMP_TEST_FILES = ("loss_scale_test.py", "policy_test.py")
# jmp's test modules import the module under test as `jmp`; this is the line we rewrite.
JMP_IMPORT = re.compile(r"^from jmp\._src import (loss_scale|policy) as jmp$", re.MULTILINE)

# Test method -> why it is deselected (every absl-parameterized case of it: test_str0, ...).
DESELECTED = {
    "test_str": (
        "reads jmp.dtype_to_names, a private table of jmp's policy module (not in "
        "jmp.__all__); tests/test_policy.py::test_get_policy_matches_jmp compares "
        "str(policy) with jmp's instead"
    ),
}
JMP_TESTS = 97  # in jmp 0.0.4, its last release
PUBLIC_TESTS = 92  # less the 5 cases of test_str

CONFTEST = """
import re

DESELECTED = {names!r}


def pytest_collection_modifyitems(config, items):
    # absl's parameterized cases are named test_str0, test_str1, ...
    pattern = re.compile("(%s)[0-9]*" % "|".join(map(re.escape, DESELECTED)))
    out = [item for item in items if pattern.fullmatch(item.name)]
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = [item for item in items if item not in out]
"""


def jmp_test_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("jmp")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("jmp is not installed (pip install jmp) so its test suite cannot be run")
    src = pathlib.Path(next(iter(spec.submodule_search_locations))) / "_src"
    missing = [name for name in JMP_TEST_FILES if not (src / name).is_file()]
    if missing:
        pytest.skip(f"this jmp install does not ship its tests {missing}")
    return src


def private_names_used(source: str, public: set[str]) -> dict[str, set[str]]:
    """Test method -> the attributes of `jmp` it reads that jmp does not export."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            used = {
                sub.attr
                for sub in ast.walk(node)
                if isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == "jmp"
            }
            if used - public:
                out[node.name] = used - public
    return out


OUTCOMES = r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)"


def summary_counts(output: str) -> dict[str, int]:
    """Parses pytest's last line ("92 passed, 5 deselected, 3 warnings in 4.2s")."""
    lines = [line for line in output.strip().splitlines() if re.search(OUTCOMES, line)]
    if not lines:
        return {}
    counts = {word: int(n) for n, word in re.findall(OUTCOMES, lines[-1])}
    if "error" in counts:
        counts["errors"] = counts.pop("error")
    return counts


def run_jmp_suite(tmp_path: pathlib.Path, target: str) -> tuple[dict[str, int], str]:
    src = jmp_test_dir()
    for name in JMP_TEST_FILES:
        text = (src / name).read_text()
        rewritten, n = JMP_IMPORT.subn(f"import {target} as jmp", text)
        assert n == 1, f"{name}: expected one `from jmp._src import ... as jmp` line, found {n}"
        (tmp_path / name).write_text(rewritten)
    (tmp_path / "conftest.py").write_text(CONFTEST.format(names=sorted(DESELECTED)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # keep this repo's pytest settings out
    env = {
        **os.environ,
        # This checkout's mpjax, whatever is installed.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        # On CPU every case runs; jmp's policy tests skip some dtypes on GPU and TPU.
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *JMP_TEST_FILES],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    return summary_counts(output), output


def test_deselected_tests_are_exactly_those_using_private_names():
    pytest.importorskip("absl.testing", reason="jmp's tests need absl-py (pip install absl-py)")
    import jmp

    src = jmp_test_dir()
    public = set(jmp.__all__)
    private = {}
    for name in JMP_TEST_FILES:
        private.update(private_names_used((src / name).read_text(), public))
    assert set(private) == set(DESELECTED), private
    assert private["test_str"] == {"dtype_to_names"}


@pytest.mark.parametrize("target", ["mpjax", "jmp"])
def test_jmp_suite_passes(tmp_path, target):
    pytest.importorskip("absl.testing", reason="jmp's tests need absl-py (pip install absl-py)")
    counts, output = run_jmp_suite(tmp_path, target)
    assert counts.get("failed", 0) == 0 and counts.get("errors", 0) == 0, output[-6000:]
    assert counts.get("passed", 0) == PUBLIC_TESTS, output[-6000:]
    assert counts.get("deselected", 0) == JMP_TESTS - PUBLIC_TESTS, output[-6000:]


_ALIAS_SCRIPT = """
import sys, warnings
import jax.numpy as jnp
import mpjax
sys.modules["jmp"] = mpjax
import jmp
from jmp._src import loss_scale
from jmp._src.policy import _cast_floating_to
import jmp._src.policy as policy
ls = jmp.DynamicLossScale(jnp.float32(2.0 ** 15))
assert isinstance(ls, loss_scale.DynamicLossScale), "a second copy of the loss-scale module"
assert loss_scale.NoOpLossScale is mpjax.NoOpLossScale and policy.Policy is mpjax.Policy
assert _cast_floating_to({"a": jnp.ones(2), "n": 3}, jnp.bfloat16)["a"].dtype == jnp.bfloat16
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loss_scale.warn_if_not_floating(jnp.int32(3), "loss_scale")
assert "Expected floating type for loss_scale" in str(caught[0].message)
print("ok")
"""


def test_jmps_private_modules_under_the_alias_are_mpjaxs_own():
    """Public scripts import from jmp's private modules (``from jmp._src.policy import
    _cast_floating_to``, ``from jmp._src import loss_scale``): with ``sys.modules["jmp"] =
    mpjax`` they get mpjax's modules, one copy, so jmp's classes are mpjax's."""
    result = subprocess.run(
        [sys.executable, "-c", _ALIAS_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_real_jmps_private_modules_are_left_to_jmp():
    pytest.importorskip("jmp")
    script = (
        "import mpjax, jmp\nfrom jmp._src import loss_scale\n"
        "assert loss_scale.__file__.endswith('jmp/_src/loss_scale.py'), loss_scale.__file__\n"
        "assert loss_scale.DynamicLossScale is not mpjax.DynamicLossScale\nprint('ok')"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
