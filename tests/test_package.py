"""mpjax as a package a team can pin: the license, the types, the version and the changelog
that goes with it, and every deprecated name with the release that removes it. The wheel
itself is built, installed and smoke-tested from outside the checkout by CI (.ci/run,
.ci/smoke.py)."""

import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest

import mpjax
import mpjax.flax  # noqa: F401 - registers its deprecated names
import mpjax.fp8  # noqa: F401
from mpjax._src import deprecations

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "docs" / "changelog.md"


def _section(text, heading):
    """The text under `heading` (a markdown heading line), up to the next heading of its level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1 :]
    found = re.search(rf"^{level} ", rest, flags=re.M)
    return rest[: found.start()] if found else rest


def test_the_license_is_apache_2_at_the_root_and_in_the_sdist():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = { text = "Apache-2.0" }' in pyproject
    assert '"LICENSE"' in pyproject  # the sdist's include list (hatchling puts it in the wheel)


def test_the_version_is_one_number_everywhere():
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, flags=re.M).group(1)
    assert mpjax.__version__ == declared == importlib.metadata.version("mpjax")
    assert re.fullmatch(r"0\.\d+\.\d+", mpjax.__version__)
    changelog = CHANGELOG.read_text()
    assert re.search(rf"^## {re.escape(mpjax.__version__)} \(\d{{4}}-\d\d-\d\d\)$", changelog, re.M)
    assert "**Versions.**" in changelog and "a patch release" in changelog  # the 0.x rules
    readme = (ROOT / "README.md").read_text()
    assert f"mpjax {mpjax.__version__}" in readme and "docs/changelog.md" in readme
    conf = (ROOT / "docs" / "conf.py").read_text()
    assert 'html_title = f"mpjax {release}"' in conf and "release = mpjax.__version__" in conf


def test_every_deprecated_name_is_listed_with_the_release_that_removes_it():
    """Each name the code deprecates (its FutureWarning alias) is a row of the changelog's
    Deprecated table for this version and of the API page's table, with the removing
    release; its warning names that release."""
    assert len(deprecations.DEPRECATED) == 5, deprecations.DEPRECATED
    section = _section(CHANGELOG.read_text(), f"## {mpjax.__version__} (2026-12-06)")
    deprecated = _section(section, "### Deprecated")
    rows = [line for line in deprecated.splitlines() if line.startswith("| `")]
    api = (ROOT / "docs" / "api.rst").read_text()
    api_table = api[api.index("Deprecated names") :]
    for old in deprecations.DEPRECATED:
        name = old if "=" in old else old.split("(")[0]
        row = [r for r in rows if r.startswith(f"| `{name}")]
        assert row and row[0].rstrip().endswith(f"| {deprecations.REMOVED_IN} |"), (old, rows)
        assert f"``{name}" in api_table, old
    assert f"removed in {deprecations.REMOVED_IN}" in api
    with pytest.warns(FutureWarning, match=rf"removed in mpjax {deprecations.REMOVED_IN}"):
        mpjax.Policy.from_level("O1", "float16", loss_scale=2.0**15)


def test_the_package_ships_its_types_and_a_users_mypy_run_reads_them(tmp_path):
    """py.typed is in the package, so a user's type checker reads mpjax's annotations: a
    correct script passes mypy --strict, and one that misuses a return type fails it."""
    assert (ROOT / "mpjax" / "py.typed").exists()
    good = tmp_path / "good.py"
    good.write_text(
        "import jax.numpy as jnp\n"
        "import optax\n"
        "import mpjax\n\n"
        "policy: mpjax.Policy = mpjax.Policy.from_level('O2', 'bfloat16')\n"
        "tx: optax.GradientTransformation = mpjax.loss_scale(optax.sgd(0.1))\n"
        "state = tx.init({'w': jnp.ones(3)})\n"
        "scale: mpjax.LossScale = mpjax.get_loss_scale(state)\n"
        "finite: bool = bool(mpjax.all_finite({'w': jnp.ones(3)}))\n"
    )
    bad = tmp_path / "bad.py"
    bad.write_text("import mpjax\n\nlevel: int = mpjax.Policy.from_level('O2')\n")
    # optax ships no annotations: a user's config skips it; mpjax's are read
    (tmp_path / "mypy.ini").write_text("[mypy]\n\n[mypy-optax.*]\nignore_missing_imports = True\n")
    mypy = [sys.executable, "-m", "mypy", "--strict", "--no-incremental"]
    ok = subprocess.run([*mypy, str(good)], capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout
    wrong = subprocess.run([*mypy, str(bad)], capture_output=True, text=True, cwd=tmp_path)
    assert wrong.returncode == 1 and "Incompatible types in assignment" in wrong.stdout
    assert 'expression has type "Policy"' in wrong.stdout
