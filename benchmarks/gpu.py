"""The GPU benchmark: every GPU target of RESULTS.md in one process, on one GPU.

    python benchmarks/gpu.py --out gpu_out                  # on the GPU machine
    python benchmarks/gpu.py --merge gpu_out/gpu.md         # here: into RESULTS.md

It measures, in this order, writing each section to ``OUT/gpu.md`` and ``OUT/gpu.json`` as soon
as it is done (a run cut short keeps what it finished):

1. the machine's two ceilings: a bf16 8192^3 matmul on random data (the "measured peak") and a
   device-to-device copy (bytes read + written), and whether XLA keeps a narrowing cast pair
   (``x.astype(bfloat16).astype(float32)``, which openxla/xla#41605 reports folded on GPU);
2. SimpleNet at the PaddlePaddle tutorial's size (9 x Linear 8192, batch 2048): O0 at
   'highest' and at the default (TF32), O1/O2/O3 in float16 and bfloat16, the hand-written
   bfloat16 step, jmp (if importable) and torch (float32, autocast + GradScaler float16,
   autocast bfloat16), interleaved; then what the audit finds the O1/O2 steps' gemms run in;
3. the Transformer LM and the ResNet (``models.py --size gpu``): O0, O1/O2 bfloat16, O2
   float16 with and without loss scaling, the hand-written ``dtype=`` step, and FP8 (base O2
   bfloat16), with the FP8 step's gemm dtypes from the optimized HLO;
4. the Adam update of 256M bfloat16 params with 8-bit moments against bfloat16 and float32
   state (``quantized_state.py``).

It installs nothing: JAX with CUDA, flax, optax and torch are what the GPU machine has. mpjax
runs from this checkout (``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import statistics
import sys
import time
import traceback

# JAX and torch share the GPU in this process: neither may take most of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
BEGIN, END = "<!-- gpu results: begin -->", "<!-- gpu results: end -->"


def _median_time(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ceilings() -> dict:
    """The measured bf16 matmul rate and copy bandwidth, and the narrowing-cast check."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    gpu = jax.default_backend() == "gpu"
    n = 8192 if gpu else 512  # a CPU run is a smoke test
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    bf16 = 2 * n**3 / _median_time(lambda: mm(a, b), 20) / 1e12
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    tf32 = 2 * n**3 / _median_time(lambda: mm(a32, b32), 10) / 1e12
    with jax.default_matmul_precision("highest"):
        mm_hi = jax.jit(lambda a, b: a @ b)
        f32 = 2 * n**3 / _median_time(lambda: mm_hi(a32, b32), 5) / 1e12
    x = jax.random.normal(jax.random.key(2), (2**29 if gpu else 2**22,), jnp.float32)  # 2 GiB
    copy = jax.jit(lambda x: x * 2)
    bandwidth = 2 * x.nbytes / _median_time(lambda: copy(x), 20) / 1e12
    v = jax.random.normal(jax.random.key(3), (2**20,), jnp.float32) * 1.001
    pair = jax.jit(lambda v: v.astype(jnp.bfloat16).astype(jnp.float32) * 3.0)(v)
    want = np.asarray(v.astype(jnp.bfloat16)).astype(np.float32) * np.float32(3.0)
    kept = bool(np.array_equal(np.asarray(pair), want))
    rows = [
        [f"bf16 matmul {n}^3, random data (the measured peak)", f"{bf16:.1f} TFLOP/s"],
        ["float32 matmul at the default precision (TF32)", f"{tf32:.1f} TFLOP/s"],
        ["float32 matmul at 'highest'", f"{f32:.1f} TFLOP/s"],
        [
            f"device-to-device copy, {x.nbytes / 2**30:g} GiB float32 (read + write)",
            f"{bandwidth:.2f} TB/s",
        ],
        ["x.astype(bf16).astype(f32) rounds to bfloat16 (narrowing cast kept)", str(kept)],
    ]
    import harness

    md = "### The GPU's ceilings, measured\n\n" + harness.table(["what", "measured"], rows)
    return {
        "bf16_tflops": bf16,
        "tf32_tflops": tf32,
        "f32_highest_tflops": f32,
        "copy_tb_s": bandwidth,
        "narrowing_cast_kept": kept,
        "markdown": md,
    }


def gemm_dtypes(report) -> dict[str, int]:
    """How many of the optimized HLO's gemms take which operand dtypes."""
    counts: collections.Counter[str] = collections.Counter()
    for kind, dtypes in report.compiled_matmuls or ():
        counts[f"{kind} {'x'.join(dtypes)}"] += 1
    return dict(counts)


def simplenet_audit(size: str) -> dict:
    """The gemms SimpleNet's O1 and O2 steps run, read from the GPU's optimized HLO."""
    import jax
    import simplenet

    import mpjax

    width, batch = simplenet.SIZES[size]
    params = simplenet.init(jax.random.key(0), width)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    y = jax.random.normal(jax.random.key(2), (batch, width))
    rows, out = [], {}
    for level in ("O1", "O2"):
        for half in ("float16", "bfloat16"):
            step, state = simplenet.mpjax_step(mpjax.Policy.from_level(level, half), params, x, y)
            counts = gemm_dtypes(mpjax.audit(step, *state))
            f32 = sum(n for k, n in counts.items() if "float32x" in k or "xfloat32" in k)
            out[f"{level} {half}"] = {"gemms": counts, "float32_gemms": f32}
            rows.append([f"{level} {half}", "; ".join(f"{k}: {n}" for k, n in counts.items()),
                         str(f32)])  # fmt: skip
    import harness

    md = "### SimpleNet's gemms in the GPU's optimized HLO (mpjax.audit)\n\n" + harness.table(
        ["step", "gemms (custom-call target, operand dtypes: count)", "float32 gemms"], rows
    )
    return {"levels": out, "markdown": md}


def fp8_gemms(size: str) -> dict:
    """The FP8 Transformer step's gemms in the optimized HLO: are FP8 gemms there?"""
    import models

    module, x, y, _ = models.build("transformer", size)
    step, state = models.fp8_step(module, x, y)
    text = step.lower(*state).compile().as_text()
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]*(?:gemm|matmul)[^"]*)"',
                                             text))  # fmt: skip
    f8 = len(re.findall(r"f8e4m3fn\[|f8e5m2\[", text))
    import harness

    rows = [[t, str(n)] for t, n in sorted(targets.items())] + [["f8 typed values", str(f8)]]
    md = "### FP8 Transformer step: gemm custom-calls in the optimized HLO\n\n" + harness.table(
        ["custom-call target", "count"], rows
    )
    return {"targets": dict(targets), "f8_values": f8, "markdown": md}


def run_sections(args) -> dict:
    import harness
    import jax

    os.makedirs(args.out, exist_ok=True)
    info = harness.machine()
    try:
        import flax
        import optax

        info["flax"], info["optax"] = flax.__version__, optax.__version__
    except ImportError:
        pass
    argv = [a if a != args.out else os.path.basename(args.out.rstrip("/")) for a in sys.argv[1:]]
    command = "python benchmarks/gpu.py " + " ".join(argv)
    header = [
        f"- Machine: {info['device']} ({info['backend']}), {info['device_count']} device(s); "
        f"{info['host']}; CPU {info.get('cpu', '?')}",
        f"- Versions: jax {info['jax']}, jaxlib {info.get('jaxlib', '?')}, flax "
        f"{info.get('flax', '?')}, optax {info.get('optax', '?')}, torch "
        f"{info.get('torch', 'not installed')}",
        f"- Command: `{command.strip()}`",
        f"- Date: {datetime.date.today().isoformat()}",
        "- Method: every variant in one process per model, interleaved round by round; ratios "
        "are medians of per-round paired ratios. Memory: XLA's compiled temp + arguments + "
        "outputs for JAX; torch's peak allocated bytes for a torch variant's model, optimizer "
        "and first steps.",
    ]
    results: dict = {"machine": info, "sections": {}}
    done: list[str] = []

    def save():
        body = "## GPU\n\n" + "\n".join(header) + "\n\n" + "\n\n".join(done) + "\n"
        with open(os.path.join(args.out, "gpu.md"), "w") as f:
            f.write(body)
        with open(os.path.join(args.out, "gpu.json"), "w") as f:
            json.dump(results, f, indent=2, default=str)

    import models
    import simplenet

    def quantized_state_section() -> dict:
        import quantized_state

        n = 2**28 if jax.default_backend() == "gpu" else 2**20
        return quantized_state.main(["--params", str(n), "--rounds", "20"])

    def model_section(kind: str) -> dict:
        return models.main(["--model", kind, "--size", args.model_size, "--rounds",
                            str(args.rounds), "--variants", args.variants])  # fmt: skip

    sections = [
        ("ceilings", ceilings),
        ("simplenet", lambda: simplenet.main(["--size", args.size, "--rounds", str(args.rounds)])),
        ("simplenet_audit", lambda: simplenet_audit(args.size)),
        ("transformer", lambda: model_section("transformer")),
        ("fp8_gemms", lambda: fp8_gemms(args.model_size)),
        ("resnet", lambda: model_section("resnet")),
        ("quantized_state", quantized_state_section),
    ]
    only = set(args.only.split(",")) if args.only else None
    for name, run in sections:
        if only and name not in only:
            continue
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            r = run()
        except Exception:  # noqa: BLE001 - one failed section must not lose the others
            tb = traceback.format_exc()
            print(tb, flush=True)
            r = {"error": tb, "markdown": f"### {name}: failed\n\n```\n{tb[-1500:]}\n```"}
        r["seconds"] = time.perf_counter() - start
        if name not in ("simplenet", "transformer", "resnet", "quantized_state"):  # print their own
            print(r["markdown"], flush=True)
        print(f"({r['seconds']:.0f} s)", flush=True)
        results["sections"][name] = r
        done.append(r["markdown"])
        save()
        jax.clear_caches()
    return results


def merge(gpu_md: str, results_md: str) -> None:
    """Puts the GPU section into RESULTS.md between its markers (replacing an earlier one)."""
    with open(gpu_md) as f:
        body = f.read().strip()
    with open(results_md) as f:
        text = f.read()
    block = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(results_md, "w") as f:
        f.write(text)
    print(f"merged {gpu_md} into {results_md}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_out", help="folder for gpu.md and gpu.json")
    parser.add_argument("--size", default="paper", help="SimpleNet size")
    parser.add_argument("--model-size", default="gpu", help="Transformer/ResNet size")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--variants",
        default="O0 default,O1 bfloat16,O2 bfloat16,O2 float16,O2 float16 no scaling,"
        "hand-written bfloat16 (dtype=),FP8 (O2 bfloat16 base)",
        help="the Transformer's and ResNet's variants (comma-separated)",
    )
    parser.add_argument("--only", help="comma-separated sections to run")
    parser.add_argument("--merge", help="a gpu.md to merge into RESULTS.md (no measuring)")
    parser.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, args.results)
        return
    run_sections(args)


if __name__ == "__main__":
    main()
