"""The benchmarks run and report every variant and target (tiny sizes; no timing asserted)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))


@pytest.mark.slow
def test_simplenet_reports_every_variant_and_target():
    simplenet = pytest.importorskip("simplenet")
    result = simplenet.main(["--size", "tiny", "--rounds", "2", "--steps", "1", "--no-torch"])
    names = [row["variant"] for row in result["rows"]]
    assert names[:2] == ["O0 default", "O0 highest"]
    assert {"O1 float16", "O2 bfloat16", "O3 float16", "O2 float16 no scaling"} <= set(names)
    assert "jmp O2 float16 (hand-written)" in names
    assert all(row["median_ms"] > 0 and row["tflops"] > 0 for row in result["rows"])
    assert result["flops_per_step"] == 2 * 32 * 64 * 64 * 26
    targets = [t["target"] for t in result["targets"]]
    assert any("loss-scale overhead" in t for t in targets)
    assert any("hand-written jmp" in t for t in targets)
    assert "| O2 bfloat16 |" in result["markdown"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet", "transformer"])
def test_flax_model_benchmarks_run(model):
    models = pytest.importorskip("models")
    result = models.main(["--model", model, "--size", "tiny", "--rounds", "1", "--steps", "1"])
    assert len(result["rows"]) == 9 and result["flops_per_step"] > 0
    assert -1 < result["loss_scale_overhead"] < 10
