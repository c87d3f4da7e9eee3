"""What FP8 buys in the GPU program, counted on any machine: a GPT-style LM's Adam train step
compiled for an NVIDIA H100 on this machine (JAX's compile-only CUDA topology, cuBLAS gemms)
at O2 bfloat16 and under each FP8 recipe, with its kernels, bytes moved, compiled temp memory
and modeled time (the roofline of ``mpjax._src.tools.gpu_program.Roofline``: each kernel the longer
of its gemm FLOPs at the peak for its operand dtype and its bytes at the bandwidth, plus a
launch).

    pip install --no-deps jax-cuda12-plugin==$JAX jax-cuda12-pjrt==$JAX   # JAX's own version
    python benchmarks/fp8_program.py                    # d_model 4096 and the GPU benchmark's
    python benchmarks/fp8_program.py --size large --json out.json
    python benchmarks/fp8_program.py --target b200      # a B200's program and roofline
    python benchmarks/fp8_program.py --target tpu7x     # a TPU7x's (libtpu: jax[tpu])

Sizes: ``large`` is d_model 4096, 2 layers, 32 heads, 4 x 1024 tokens (where FP8 should pay:
the gemms dominate); ``gpu`` is ``models.py``'s Transformer at ``--size gpu`` (d_model 2048, 8
layers, 16 heads, 8 x 1024 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import models  # noqa: E402
import optax  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402
import mpjax.fp8  # noqa: E402

VOCAB = 1024
# (width, depth, heads, seq, batch)
SIZES = {
    "large": (4096, 2, 32, 1024, 4),
    "gpu": models.SIZES["transformer"]["gpu"],
    "tiny": (64, 1, 2, 32, 2),
}
RECIPES = {
    "O2 bfloat16": None,
    "FP8 delayed": mpjax.fp8.DelayedScaling(),
    "FP8 current": mpjax.fp8.CurrentScaling(),
    "FP8 current per row": mpjax.fp8.CurrentScaling(granularity="row"),
    # Blackwell's recipe: cuDNN block-scaled dots on a B200, emulated elsewhere (an H100)
    "MXFP8": mpjax.fp8.MXFP8BlockScaling(),
    # and its 4-bit one (E2M1 gemms on a B200)
    "NVFP4": mpjax.fp8.NVFP4BlockScaling(),
}


def abstract_step(size: str, recipe: Any) -> tuple[Any, tuple[Any, ...]]:
    """(step, its arguments as shape structs), built under ``jax.eval_shape``: no parameter of
    the model is made on this machine."""
    width, depth, heads, seq, batch = SIZES[size]
    module = models.TransformerLM(VOCAB, width, depth, heads)
    base = mpjax.Policy.from_level("O2", "bfloat16")
    pol = base if recipe is None else mpjax.fp8.FP8Policy(base, recipe)
    model = mpjax.flax.wrap(module, pol)
    tx = optax.adam(1e-3)

    def loss_fn(p: Any, tokens: Any) -> Any:
        logits = model.apply({"params": p}, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def make() -> Any:
        tokens = jnp.zeros((batch, seq + 1), jnp.int32)
        params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
        opt_state = tx.init(params)
        if recipe is None:
            return params, opt_state, tokens
        return params, opt_state, mpjax.fp8.init(loss_fn, pol, params, tokens), tokens

    def step(params: Any, opt_state: Any, tokens: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def fp8_step(params: Any, opt_state: Any, fp8_state: Any, tokens: Any) -> Any:
        grad_fn = mpjax.fp8.scaled_value_and_grad(loss_fn, pol)
        loss, grads, fp8_state = grad_fn(fp8_state, params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, fp8_state, loss

    args = jax.eval_shape(make)
    return (step if recipe is None else fp8_step), args


# Hopper's recipes: MXFP8 and NVFP4 are Blackwell's (on an H100 their gemms are emulated)
HOPPER = ("O2 bfloat16", "FP8 delayed", "FP8 current", "FP8 current per row")


def measure(
    size: str, target: str = "h100", names: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The rows of `size`'s step under each recipe (those `names`, else all) in `target`'s
    program."""
    rows = {}
    for name, recipe in RECIPES.items():
        if names is not None and name not in names:
            continue
        start = time.perf_counter()
        step, args = abstract_step(size, recipe)
        report = mpjax.audit(step, *args, target=target)
        program = report.gpu or report.tpu
        assert program is not None
        rows[name] = {
            "kernels": len(program.kernels),
            "bytes_moved": program.bytes_moved,
            "temp_bytes": program.temp_bytes,
            "modeled_seconds": program.modeled_seconds(),
            "gemm_seconds": sum(
                program.roofline().seconds(k) for k in program.kernels if k.kind == "gemm"
            ),
            "gemm_dtypes": program.gemm_dtypes(),
            "by_kind": {k: list(v) for k, v in program.by_kind().items()},
            "compile_seconds": round(time.perf_counter() - start, 1),
        }
        print(
            f"  {size} {name}: {rows[name]['kernels']} kernels, "
            f"{rows[name]['bytes_moved'] / 1e9:.1f} GB, "
            f"{rows[name]['modeled_seconds'] * 1e3:.2f} ms ({rows[name]['compile_seconds']} s)",
            file=sys.stderr,
        )
    return {"size": size, "shape": SIZES[size], "target": target, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    base = rows["O2 bfloat16"]
    width, depth, heads, seq, batch = result["shape"]
    out = [
        f"{result['target'].upper()} program, GPT-style LM d_model {width}, {depth} layers, "
        f"{heads} heads, "
        f"{batch} x {seq} tokens, Adam"
        + (":" if result["target"].startswith("tpu") else " (cuBLAS gemms):"),
        "",
        "| step | kernels | GB moved | compiled temp | modeled ms | gemm ms | vs O2 bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        out.append(
            f"| {name} | {r['kernels']} | {r['bytes_moved'] / 1e9:.1f} | "
            f"{r['temp_bytes'] / 2**20:,.0f} MiB | {r['modeled_seconds'] * 1e3:.2f} | "
            f"{r['gemm_seconds'] * 1e3:.2f} | "
            f"{base['modeled_seconds'] / r['modeled_seconds']:.2f}x |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, action="append")
    parser.add_argument("--target", choices=["h100", "b200", "tpu7x"], action="append")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    results = [
        measure(size, target)
        for target in args.target or ["h100"]
        for size in args.size or ["large", "gpu"]
    ]
    for result in results:
        print(markdown(result), end="\n\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
