"""The README's Python blocks run as written, it links every guide, and its test command is
the one .ci/run runs."""

import pathlib
import re

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_quickstart_runs_and_trains(capsys):
    namespace: dict = {}
    exec(compile(python_blocks()[0], "README quickstart", "exec"), namespace)
    metrics = namespace["mpjax"].loss_scale_metrics(namespace["opt_state"])
    assert int(metrics["skipped_steps"]) == 0 and bool(metrics["last_step_finite"])
    params = namespace["params"]
    assert {v.dtype for v in jax.tree_util.tree_leaves(params)} == {np.dtype("float32")}
    assert "loss_scale" in capsys.readouterr().out


def test_every_python_block_runs_on_its_own():
    # A reader copies one block at a time: each carries its own imports.
    for i, block in enumerate(python_blocks()):
        exec(compile(block, f"README block {i}", "exec"), {"__name__": "readme"})


def test_readme_links_every_guide():
    guides = sorted((ROOT / "docs" / "guides").glob("*.md"))
    assert guides
    for guide in guides:
        assert f"(docs/guides/{guide.name})" in README, guide.name


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command.strip() in (ROOT / ".ci" / "run").read_text()
