"""The examples train (short runs): the flagship at every level, with its loss-scale story."""

import io
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))


LEVEL_RUNS = [
    "O0 float32",
    "O1 float16",
    "O1 bfloat16",
    "O2 float16",
    "O2 bfloat16",
    "O3 float16",
    "O3 bfloat16",
    "FP8 O2 bfloat16",
]
SCALING_RUNS = [
    "O0 float32, loss x2^-20",
    "O2 float16, no scale",
    "O2 float16, loss x2^-20, no scale",
    "O2 float16, loss x2^-20, dynamic scale",
]


@pytest.mark.slow
def test_train_digits(tmp_path, capsys):
    train_digits = pytest.importorskip("train_digits")
    # Bars on (no --no-bar): stderr is not a terminal here, so none may be drawn.
    returned = train_digits.main(["--epochs", "8", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "\r" not in out + err  # no tqdm carriage returns in a log
    assert (tmp_path / "digits_loss.png").stat().st_size > 10_000
    results = json.loads((tmp_path / "digits_results.json").read_text())
    assert [r["run"] for r in results] == [r["run"] for r in returned]
    assert [r["run"] for r in results] == LEVEL_RUNS + SCALING_RUNS
    run = {r["run"]: r for r in results}
    n_steps = len(run["O0 float32"]["losses"])
    assert n_steps == 8 * (1437 // 64)

    # Every level trains to O0's accuracy; FP8 (O2 bfloat16 base) as bf16 O2, with one FP8 dot.
    acc = {name: r["test_accuracy"] for name, r in run.items()}
    assert acc["O0 float32"] > 0.93
    for name in LEVEL_RUNS[1:-1]:
        assert abs(acc[name] - acc["O0 float32"]) <= 0.01, name
    assert abs(acc["FP8 O2 bfloat16"] - acc["O2 bfloat16"]) <= 0.015
    assert [run[n]["fp8_sites"] for n in LEVEL_RUNS] == [0] * 7 + [1]

    # The float16 O1/O2 runs' dynamic scale moves within the run: it starts at the 2^24 cap,
    # backs off on overflow (each such step skipped and recorded), and grows back.
    for name in ("O1 float16", "O2 float16"):
        r = run[name]
        scales, skipped = r["loss_scales"], r["skipped_at"]
        assert r["loss_scaling"] == "dynamic" and r["scale_config"]["period"] == 40
        assert len(scales) == n_steps and scales[0] == 2.0**24
        assert r["scale_backoffs"] >= 1 and r["scale_growths"] >= 1
        assert r["skipped_steps"] == len(skipped) >= 1
        after = [*scales[1:], r["final_loss_scale"]]  # the scale after each step
        for i in range(n_steps):  # a skipped step halves the scale; no other step lowers it
            if i in skipped:
                assert after[i] == scales[i] / 2, (name, i)
            else:
                assert after[i] >= scales[i], (name, i)
        assert any(after[i] == 2 * scales[i] for i in range(n_steps))
    # bfloat16, O0 and O3 run no scale at all, and say so (no history of ones).
    for name in ("O0 float32", "O1 bfloat16", "O2 bfloat16", "O3 float16", "FP8 O2 bfloat16"):
        r = run[name]
        assert r["loss_scaling"] == "none" and r["loss_scales"] is None, name
        assert r["skipped_steps"] == 0 and r["final_loss_scale"] is None, name

    # Why float16 needs the scale: at a large model's gradient size (loss x2^-20, lr x2^20)
    # float16 without a scale underflows to all-zero gradients and learns nothing; the
    # dynamic scale trains as float32 does, and float32 is bit-identical to the unweighted O0.
    assert run["O0 float32, loss x2^-20"]["losses"] == run["O0 float32"]["losses"]
    unscaled = run["O2 float16, loss x2^-20, no scale"]
    scaled = run["O2 float16, loss x2^-20, dynamic scale"]
    f32 = run["O0 float32, loss x2^-20"]
    assert unscaled["loss_scaling"] == "none" and unscaled["dtype"] == "float16"
    assert unscaled["zero_grad_share"] > 0.99 and unscaled["test_accuracy"] < 0.3
    assert scaled["loss_scaling"] == "dynamic"
    assert scaled["zero_grad_share"] < f32["zero_grad_share"] + 0.1
    assert abs(scaled["test_accuracy"] - f32["test_accuracy"]) <= 0.02
    # At this CNN's own gradient size float16 trains without a scale, losing some entries.
    plain = run["O2 float16, no scale"]
    assert abs(plain["test_accuracy"] - acc["O0 float32"]) <= 0.01
    assert plain["zero_grad_share"] > f32["zero_grad_share"]
    assert all(len(run[n]["zero_grad_shares"]) == n_steps for n in SCALING_RUNS)

    # A verdict per level, computed from the measured numbers, printed and in the JSON.
    assert "What each level bought on this machine" in out
    o0 = run["O0 float32"]
    for name in LEVEL_RUNS[1:]:
        r = run[name]
        line = r["verdict"]
        assert line.startswith(f"{name}: bought ") and f"- {line}" in out, name
        speed = r["steps_per_s"] / o0["steps_per_s"]
        assert f"{speed:.2f}x O0's speed" in line, name
        assert f"{r['temp_bytes'] / o0['temp_bytes'] - 1:+.0%} step memory" in line, name
    assert "verdict" not in o0 and all("verdict" not in run[n] for n in SCALING_RUNS)
    # O3 keeps half params: half the params and optimizer state of O0 (a measured number).
    assert run["O3 float16"]["state_bytes"] == pytest.approx(o0["state_bytes"] / 2, rel=0.01)
    assert "less params+opt state" in run["O3 float16"]["verdict"]

    # The memory column: the step's temporary buffers, as XLA's memory analysis reports them.
    # This model's are mostly gradients and optimizer temporaries (8x8 images), and on CPU
    # half math adds float32 copies for XLA's float32 matmuls, so whether a level saves here
    # depends on the XLA release; tests/test_memory.py pins what a cast costs exactly.
    assert all(run[n]["temp_bytes"] > 0 for n in LEVEL_RUNS)
    assert "| vs O0 |" in train_digits.table(results)


@pytest.mark.slow
def test_train_digits_draws_bars_on_a_terminal(monkeypatch):
    train_digits = pytest.importorskip("train_digits")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    data = train_digits.load_data()
    train_digits.train("O0", "float16", 2, 64, 0.05, 0, data, bar=True)
    assert "\r" in terminal.getvalue() and "2/2" in terminal.getvalue()


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
