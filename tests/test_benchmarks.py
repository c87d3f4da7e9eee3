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
    assert {"jmp O2 float16 (hand-written)", "hand-written bfloat16 (.astype)"} <= set(names)
    assert all(row["median_ms"] > 0 and row["tflops"] > 0 for row in result["rows"])
    assert result["flops_per_step"] == 2 * 32 * 64 * 64 * 26
    targets = [t["target"] for t in result["targets"]]
    assert any("loss-scale overhead" in t for t in targets)
    assert any("hand-written jmp" in t for t in targets)
    assert any("within 1.03x of the hand-written bf16 step" in t for t in targets)
    assert "| O2 bfloat16 |" in result["markdown"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet", "transformer"])
def test_flax_model_benchmarks_run(model):
    models = pytest.importorskip("models")
    result = models.main(["--model", model, "--size", "tiny", "--rounds", "1", "--steps", "1"])
    names = [row["variant"] for row in result["rows"]]
    assert len(names) == 10 and names[-1] == "hand-written bfloat16 (dtype=)"
    assert result["flops_per_step"] > 0
    assert -1 < result["loss_scale_overhead"] < 10


@pytest.mark.slow
def test_memory_benchmark_reports_every_variant_and_target():
    memory = pytest.importorskip("memory")
    out = memory.main(["--model", "transformer", "--size", "tiny", "--rounds", "0"])
    (result,) = out["results"]
    rows = result["rows"]
    assert set(rows) == {name for name, _ in memory.variants()}
    assert {"hand-written float16 (dtype=)", "dtype= float16, loss_scale chain form"} <= set(rows)
    for name, row in rows.items():
        counts = ("residual_bytes", "temp_bytes", "fusion_bytes", "flops")
        assert all(row[c] > 0 for c in counts), (name, row)
    # Counted, not timed: O2 saves half-size residuals where float32 saves full ones.
    assert rows["mpjax O2 bfloat16"]["residual_bytes"] < rows["float32"]["residual_bytes"]
    # Every (level, metric, half) target and the two loss-scaling ones.
    assert len(result["targets"]) == 2 * len(memory.LIMITS) + 2
    assert "| mpjax O2 bfloat16 |" in result["markdown"]


def test_fusion_bytes_counts_each_kernels_operands_and_results():
    memory = pytest.importorskip("memory")
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x, w: jnp.tanh(x @ w).astype(jnp.bfloat16).sum())
    text = f.lower(jnp.ones((4, 8)), jnp.ones((8, 8))).compile().as_text()
    # At least the inputs (4x8 and 8x8 float32) read and the bfloat16 scalar written; at most
    # that plus the dot's 4x8 float32 result written and read again (XLA may fuse the two).
    assert 4 * (32 + 64) + 2 <= memory.fusion_bytes(text) <= 4 * (32 + 64 + 32 + 32) + 2


@pytest.mark.slow
def test_sharding_benchmark_meets_its_o2_targets_on_8_devices(tmp_path):
    # The benchmark sets up 8 CPU devices for itself, so it runs in its own process.
    import json
    import os
    import subprocess

    script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "sharding.py"
    out = tmp_path / "sharding.json"
    layouts = ["--layout", "explicit dp"]  # the others: RESULTS.md (each layout ~1 min here)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [
        sys.executable,
        str(script),
        *layouts,
        "--batch",
        "16",
        "--seq",
        "16",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["layout"] for r in results] == ["explicit dp"]
    for result in results:
        rows = result["rows"]
        assert len(rows) == 13 and all(r["collective_bytes"] for r in rows.values())
        # Reduced in float32 on request: every gradient byte moves as float32.
        assert set(rows["mpjax O2 bfloat16 reduce float32"]["collective_bytes"]) == {"float32"}
        # What O2 moves: no more bytes than the hand-written step, and no float32 where it
        # moves half. (Temp memory is a few KiB at this size; RESULTS.md has the full size.)
        met = {t["target"]: t["met"] for t in result["targets"]}
        o2 = {t: m for t, m in met.items() if t.startswith("O2") and "temp" not in t}
        assert len(o2) == 2 and all(o2.values()), result["targets"]


def test_gpu_results_merge_into_results_md_and_replace_an_earlier_run(tmp_path):
    gpu = pytest.importorskip("gpu")
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n### CPU rows\n")
    for run in ("first", "second"):
        (tmp_path / "gpu.md").write_text(f"## GPU\n\n{run} run\n")
        gpu.merge(str(tmp_path / "gpu.md"), str(results))
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\n### CPU rows\n")
    assert "second run" in text and "first run" not in text
    assert text.count(gpu.BEGIN) == 1 and text.count(gpu.END) == 1


@pytest.mark.slow
def test_gpu_benchmark_runs_its_sections_on_cpu_and_saves_each(tmp_path):
    gpu = pytest.importorskip("gpu")
    out = tmp_path / "out"
    gpu.main(["--out", str(out), "--size", "tiny", "--model-size", "tiny", "--rounds", "1",
              "--only", "ceilings,simplenet_audit"])  # fmt: skip
    text = (out / "gpu.md").read_text()
    assert "failed" not in text and "| x.astype(bf16).astype(f32) rounds" in text
    # On a CPU XLA runs half matmuls in float32: the audit counts them as float32 gemms.
    assert "| O2 bfloat16 | dot float32xfloat32: 26 | 26 |" in text


@pytest.mark.slow
def test_quantized_state_benchmark_counts_bytes_per_param():
    quantized_state = pytest.importorskip("quantized_state")
    result = quantized_state.main(["--params", "65536", "--rounds", "2"])
    md = result["markdown"]
    assert set(result["times"]) == set(quantized_state.variants())
    # params + state, counted from the pytrees: 4 + 8, 2 + 4, and 2 + 1 + 1 + 2 * 4 / 256 (a
    # float32 scale per block of 256, for each of the two moments).
    assert "| 12.00 |" in md and "| 6.00 |" in md and "| 4.03 |" in md, md


@pytest.mark.slow
def test_update_ulp_study_separates_the_rounding_modes():
    update_ulp = pytest.importorskip("update_ulp")
    result = update_ulp.main(["--seeds", "1", "--lrs", "1e-4,1e-2"])
    shares = {k: v[0] for k, v in result["shares"].items()}
    # Updates of about 1% of an ulp: round to nearest never moves; the compensated sum keeps
    # float32's progress; at about one ulp round to nearest moves too.
    assert shares["sgd, bf16 nearest @ lr 0.0001"] == 0.0
    assert shares["sgd, bf16 kahan @ lr 0.0001"] > 0.9
    assert shares["sgd, bf16 nearest @ lr 0.01"] > 0.5
    assert shares["momentum, 8-bit momentum, f32 params @ lr 0.0001"] > 0.9


@pytest.mark.slow
def test_half_params_corpus_benchmark_runs():
    corpus = pytest.importorskip("half_params_corpus")
    result = corpus.main(["--steps", "2", "--seeds", "1", "--models", "bert"])
    assert set(result["final"]["bert"]) == set(corpus.RUNS)
    assert "| bert | bf16 stochastic + 8-bit moments |" in result["markdown"]


@pytest.mark.slow
def test_fp8_accuracy_benchmark_trains_every_variant():
    fp8_accuracy = pytest.importorskip("fp8_accuracy")
    result = fp8_accuracy.main(["--size", "tiny", "--steps", "3", "--seeds", "2"])
    assert set(result["final"]) == set(fp8_accuracy.VARIANTS)
    for variant, losses in result["final"].items():
        assert len(losses) == 2 and all(0.0 < v < 10.0 for v in losses), (variant, losses)
    assert "within 2 sd of O2 bfloat16's seeds" in result["markdown"]
