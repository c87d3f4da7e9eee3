"""The smoke test of mpjax as users get it: run from outside the checkout, with the wheel
installed into a fresh environment (.ci/run builds and installs it).

    python /path/to/checkout/.ci/smoke.py /path/to/checkout

It checks that mpjax comes from the installed wheel (not the checkout), that every public
module imports, that the wheel carries its LICENSE and py.typed, and runs the README's
quickstart and the first code block of each guide (one per area)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import pathlib
import re
import sys
import tempfile
import time

PUBLIC = ("mpjax", "mpjax.flax", "mpjax.fp8", "mpjax.export", "mpjax.checkpoint")


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def run(name: str, code: str) -> None:
    start = time.perf_counter()
    before = os.getcwd()
    with tempfile.TemporaryDirectory() as where:
        os.chdir(where)  # contextlib.chdir is Python 3.11's
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        finally:
            os.chdir(before)
    print(f"ran {name} ({time.perf_counter() - start:.1f} s)")


def main(checkout: pathlib.Path) -> None:
    import mpjax

    where = pathlib.Path(mpjax.__file__).resolve()
    if checkout.resolve() in where.parents:
        sys.exit(f"mpjax was imported from the checkout ({where}), not from the installed wheel")
    print(f"mpjax {mpjax.__version__} from {where.parent}")
    if mpjax.__version__ != importlib.metadata.version("mpjax"):
        sys.exit(f"mpjax.__version__ {mpjax.__version__} is not the wheel's version")
    for module in PUBLIC:
        importlib.import_module(module)
    files = {str(f) for f in importlib.metadata.files("mpjax") or ()}
    for wanted in ("mpjax/py.typed", "LICENSE"):
        if not any(f.endswith(wanted) for f in files):
            sys.exit(f"the wheel has no {wanted}")
    readme = (checkout / "README.md").read_text()
    quickstart = python_blocks(checkout / "docs" / "index.md")[0]
    if quickstart not in readme:
        sys.exit("the README's quickstart is not docs/index.md's first block")
    run("README quickstart", quickstart)
    for guide in sorted((checkout / "docs" / "guides").glob("*.md")):
        blocks = python_blocks(guide)
        if blocks:
            run(f"{guide.name} (first block)", blocks[0])
    print("smoke test passed")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(pathlib.Path(sys.argv[1]))
