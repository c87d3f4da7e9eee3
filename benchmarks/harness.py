"""Shared benchmark harness: interleaved timing, paired ratios, machine info, JSON/markdown.

Machines are noisy, so every variant runs in the same process, round by round in turn, and
each round's time is divided by the baseline's time in the same round; tables report the
median of those paired ratios.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def block(tree: Any) -> Any:
    """Waits for every array in `tree` (works for torch tensors too, via their `.item`)."""
    return jax.block_until_ready(tree)


def interleave(
    variants: dict[str, Callable[[], Any]], rounds: int, sync: Callable[[Any], Any] = block
) -> dict[str, list[float]]:
    """Times each zero-argument callable once per round, in turn; returns seconds per call."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            sync(run())
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """Median over rounds of time[name] / time[baseline] (below 1: faster than baseline)."""
    return statistics.median(a / b for a, b in zip(times[name], times[baseline], strict=True))


def machine() -> dict[str, Any]:
    """The device, backend and versions, for the results file."""
    device = jax.devices()[0]
    info = {
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "device_count": jax.device_count(),
        "host": f"{platform.system()} {platform.machine()}, {platform.python_version()}",
        "jax": jax.__version__,
    }
    try:
        import jaxlib

        info["jaxlib"] = jaxlib.__version__
    except ImportError:  # pragma: no cover
        pass
    try:  # the CPU model and its half-precision instructions (Linux)
        with open("/proc/cpuinfo") as f:
            text = f.read()
        model = next(
            line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line
        )
        flags = sorted({f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")
                        if f" {f}" in text})  # fmt: skip
        info["cpu"] = f"{model}, {os.cpu_count()} cores, flags: {' '.join(flags) or 'none'}"
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or "unknown"
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def matmul_peak_tflops(dtype: Any, n: int, repeats: int = 10) -> float:
    """A measured matmul peak: TFLOP/s of an n x n x n matmul in `dtype` (best of repeats)."""
    # Random operands: zeros or ones can run faster than real data on a GPU.
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    block(f(a, b))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        block(f(a, b))
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def compile_once(jitted: Any, *args: Any) -> tuple[Any, float | None]:
    """The compiled step (called in place of `jitted`, so each variant compiles once) and its
    temp + argument + output bytes from XLA's memory analysis, in MiB (None if absent)."""
    try:
        compiled = jitted.lower(*args).compile()
    except TypeError:  # jmp's DynamicLossScale cannot be lowered ahead of time: run it jitted
        return jitted, None
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports it
        analysis = None
    if analysis is None:
        return compiled, None
    total = sum(
        getattr(analysis, name, 0) or 0
        for name in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    )
    return compiled, total / 2**20


def write(path: str | None, result: dict[str, Any]) -> None:
    """Writes `result` as JSON to `path` (if given)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def level_variants(halves: tuple[str, ...] = ("float16", "bfloat16")) -> list[tuple[str, Any]]:
    """(name, policy or precision) for O0 at default and 'highest' matmul precision, and
    O1/O2/O3 in each half dtype, plus O2 float16 with the loss scale switched off (for the
    loss-scale overhead)."""
    import mpjax

    out: list[tuple[str, Any]] = [("O0 default", "default"), ("O0 highest", "highest")]
    for level in ("O1", "O2", "O3"):
        for half in halves:
            out.append((f"{level} {half}", mpjax.Policy.from_level(level, half)))
    if "float16" in halves:
        noop = mpjax.Policy.from_level("O2", "float16", loss_scaling="none")
        out.append(("O2 float16 no scaling", noop))
    return out


def report(
    title: str,
    times: dict[str, list[float]],
    flops: float,
    memory: dict[str, float | None],
    baseline: str,
    peak: float | None,
    peak_label: str,
) -> tuple[list[dict[str, Any]], str]:
    """Rows (for JSON) and a markdown table: median ms, ratio to baseline, TFLOP/s, share of
    the measured peak, compiled memory."""
    rows, cells = [], []
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = paired_ratio(times, name, baseline)
        tflops = flops / med / 1e12
        share = tflops / peak if peak else None
        mem = memory.get(name)
        rows.append(
            {
                "variant": name,
                "median_ms": 1e3 * med,
                "ratio_to_baseline": ratio,
                "speedup_vs_baseline": 1 / ratio,
                "tflops": tflops,
                "share_of_peak": share,
                "compiled_memory_mb": mem,
            }
        )
        cells.append(
            [
                name,
                f"{1e3 * med:.2f}",
                f"{ratio:.3f}",
                f"{1 / ratio:.2f}x",
                f"{tflops:.3f}",
                "n/a" if share is None else f"{100 * share:.1f}%",
                "n/a" if mem is None else f"{mem:.1f}",
            ]
        )
    headers = [
        "variant",
        "median step (ms)",
        f"ratio to {baseline}",
        "speed-up",
        "TFLOP/s",
        f"share of {peak_label}",
        "compiled memory (MiB)",
    ]
    return rows, f"### {title}\n\n" + table(headers, cells)
