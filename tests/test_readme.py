"""The README's Python blocks run as written, and its commands match .ci/run."""

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


def test_level_examples_run():
    exec(compile("import mpjax\n" + python_blocks()[1], "README levels", "exec"), {})


def test_autocast_and_flax_examples_run(capsys):
    blocks = [
        b
        for b in python_blocks()[1:]
        if ("mpjax.autocast(" in b or "mpjax.flax.wrap(" in b) and "mpjax.fp8" not in b
    ]
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        namespace: dict = {}
        exec(compile(block, f"README block {i}", "exec"), namespace)
    assert namespace["state"].step == 1
    assert "skipped_steps" in capsys.readouterr().out


def test_fp8_flax_example_runs(capsys):
    (block,) = [b for b in python_blocks() if "mpjax.fp8" in b and "mpjax.flax.wrap(" in b]
    namespace: dict = {}
    exec(compile(block, "README FP8 with Flax", "exec"), namespace)
    assert namespace["fp8_state"].num_sites == 1  # Dense_1 is kept in float32
    assert len(namespace["report"].fp8_matmuls) == 2
    assert "input_amax" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command.strip() in (ROOT / ".ci" / "run").read_text()


def test_audit_table_in_readme_is_the_quickstarts_real_audit():
    import pytest

    import mpjax

    if jax.default_backend() != "cpu":
        pytest.skip("the README shows the CPU audit")
    namespace: dict = {}
    exec(compile(python_blocks()[0], "quickstart.py", "exec"), namespace)
    report = mpjax.audit(
        namespace["train_step"],
        namespace["params"],
        namespace["opt_state"],
        namespace["x"],
        namespace["y"],
    )
    shown = re.search(r"```text\n>>> print\(mpjax.audit.*?\n(.*?)```", README, flags=re.S).group(1)
    assert shown.strip() == str(report).strip()
