"""The flagship example trains every level to O0's accuracy, and FP8 to bf16 O2's (short run)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))


@pytest.mark.slow
def test_train_digits_levels_match_o0_accuracy(tmp_path):
    train_digits = pytest.importorskip("train_digits")
    results = train_digits.main(["--epochs", "8", "--no-bar", "--out", str(tmp_path)])
    assert len(results) == 8
    acc = {r["run"]: r["test_accuracy"] for r in results}
    assert acc["O0 float32"] > 0.93
    for run in ("O1 float16", "O1 bfloat16", "O2 float16", "O2 bfloat16"):
        assert abs(acc[run] - acc["O0 float32"]) <= 0.01, run
    # FP8 (O2 bfloat16 base, last): its 1024x128 Dense is an FP8 site; accuracy as bf16 O2.
    assert results[-1]["run"] == "FP8 O2 bfloat16" and results[-1]["fp8_sites"] == 1
    assert abs(acc["FP8 O2 bfloat16"] - acc["O2 bfloat16"]) <= 0.015
    assert all(r["fp8_sites"] == 0 for r in results[:-1])
    assert all(r["skipped_steps"] == 0 for r in results)
    assert (tmp_path / "digits_loss.png").stat().st_size > 10_000
    assert results[1]["final_loss_scale"] == 2.0**15  # O1 float16 runs a dynamic scale
    # The memory column: the step's temporary buffers, as XLA's memory analysis reports them.
    # This model's are mostly gradients and optimizer temporaries (8x8 images), and on CPU
    # half math adds float32 copies for XLA's float32 matmuls, so whether a level saves here
    # depends on the XLA release; tests/test_memory.py pins what a cast costs exactly.
    assert all(r["temp_bytes"] > 0 for r in results)
    assert "| vs O0 |" in train_digits.table(results)


@pytest.mark.slow
def test_loss_scaling_matters_shows_underflow_and_its_fix():
    example = pytest.importorskip("loss_scaling_matters")
    f32, unscaled, scaled = example.main(["--epochs", "3"])
    assert unscaled["zero_gradient_share"] > 0.95  # float16 gradients underflow to zero
    assert scaled["zero_gradient_share"] < f32["zero_gradient_share"] + 0.05
    assert scaled["final_loss_scale"] >= 2.0**15 and unscaled["test_accuracy"] < 0.5
    assert abs(scaled["test_accuracy"] - f32["test_accuracy"]) <= 0.02


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, args",
    [
        ("nnx_digits", ["--level", "O2", "--dtype", "float16"]),
        ("autocast_jax", ["--level", "O1", "--dtype", "bfloat16"]),
    ],
)
def test_nnx_and_autocast_examples_train(name, args):
    example = pytest.importorskip(name)
    result = example.main([*args, "--epochs", "12"])
    assert result["test_accuracy"] > 0.93
