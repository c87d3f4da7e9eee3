"""How each way of storing bfloat16 params (and 8-bit moments) keeps small updates.

    python benchmarks/update_ulp.py [--steps 400] [--seeds 3]

A linear least-squares fit with weights near 1, where bfloat16's gap between neighbours (its
ulp) is 2**-7. Each learning rate sets how large a step's update is next to that ulp (the
ratio, measured on the first step); each way trains for the same steps from the same start,
and the table gives the share of float32's loss reduction it reaches (mean ± std over the
seeds; 100% is float32's, 0% is not moving):

- SGD: ``mpjax.half_updates(optax.sgd(lr), mode)`` for mode ``"nearest"``, ``"stochastic"``
  and ``"kahan"``, against ``optax.sgd(lr)`` on float32 params;
- SGD with momentum 0.9, its momentum in 8 bits: ``mpjax.quantize_moments(...)`` on float32
  params (the state's rounding alone), and with bfloat16 params under ``half_updates``
  (``"stochastic"``), against float32 SGD with momentum;
- Adam, its moments in 8 bits, bfloat16 params (``half_updates(quantize_moments(adam))``),
  against float32 Adam at the same learning rate.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import mpjax  # noqa: E402

ULP = 2.0**-7  # bfloat16's gap between neighbours in [1, 2)


def problem(seed: int, n: int = 256, d: int = 16):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, d))
    w_true = 1.0 + 0.5 * jax.random.normal(kw, (d,))
    return x, x @ w_true


def ways(lr: float) -> dict[str, tuple[str, optax.GradientTransformation, object]]:
    """name -> (the float32 reference it is judged against, transformation, param dtype)."""
    sgd, mom, adam = optax.sgd(lr), optax.sgd(lr, momentum=0.9), optax.adam(lr)
    bf16 = jnp.bfloat16
    return {
        "sgd, bf16 nearest": ("sgd", mpjax.half_updates(sgd, "nearest"), bf16),
        "sgd, bf16 stochastic": ("sgd", mpjax.half_updates(sgd, "stochastic"), bf16),
        "sgd, bf16 kahan": ("sgd", mpjax.half_updates(sgd, "kahan"), bf16),
        "momentum, 8-bit momentum, f32 params": (
            "momentum",
            mpjax.quantize_moments(mom, min_size=1),
            jnp.float32,
        ),
        "momentum, 8-bit momentum, bf16 stochastic": (
            "momentum",
            mpjax.half_updates(mpjax.quantize_moments(mom, min_size=1)),
            bf16,
        ),
        "adam, 8-bit moments, bf16 stochastic": (
            "adam",
            mpjax.half_updates(mpjax.quantize_moments(adam, min_size=1)),
            bf16,
        ),
        "adam, bf16 moments, bf16 stochastic": (
            "adam",
            mpjax.half_updates(adam, state_dtype=bf16),
            bf16,
        ),
    }, {"sgd": sgd, "momentum": mom, "adam": adam}


def train(tx, dtype, seed: int, steps: int) -> tuple[float, float, float]:
    """(start loss, final loss, first update's mean |update| / ulp)."""
    x, y = problem(seed)
    params = {"w": jnp.ones(x.shape[1], dtype)}

    def loss(p):
        return jnp.mean((x @ p["w"].astype(jnp.float32) - y) ** 2)

    def step(carry, _):
        p, s = carry
        u, s = tx.update(jax.grad(loss)(p), s, p)
        return (optax.apply_updates(p, u), s), None

    g0 = jax.grad(loss)({"w": jnp.ones(x.shape[1])})
    u0, _ = optax.sgd(1.0).update(g0, optax.sgd(1.0).init(g0))  # the gradient, unscaled
    (p, _), _ = jax.jit(lambda c: jax.lax.scan(step, c, None, length=steps))(
        (params, tx.init(params))
    )
    return float(loss(params)), float(loss(p)), float(jnp.mean(jnp.abs(u0["w"])))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lrs", default="1e-5,1e-4,1e-3,1e-2")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    lrs = [float(v) for v in args.lrs.split(",")]
    cells: dict[str, list[str]] = {}
    ratios: dict[str, list[str]] = {}
    result: dict = {"config": vars(args), "shares": {}}
    for lr in lrs:
        named, refs = ways(lr)
        ref = {
            k: [train(tx, jnp.float32, s, args.steps) for s in range(args.seeds)]
            for k, tx in refs.items()
        }
        for name, (ref_name, tx, dtype) in named.items():
            shares = []
            for s in range(args.seeds):
                start, end, _ = train(tx, dtype, s, args.steps)
                ref_start, ref_end, _ = ref[ref_name][s]
                shares.append((start - end) / (ref_start - ref_end))
            # The update/ulp ratio of the way's first step: SGD steps lr * |g|, Adam about lr.
            grad = np.mean([r[2] for r in ref["sgd"]])
            ratio = lr if ref_name == "adam" else lr * grad
            ratios.setdefault(name, []).append(f"{ratio / ULP:.2g}")
            cells.setdefault(name, []).append(
                f"{100 * np.mean(shares):.0f} ± {100 * np.std(shares):.0f}%"
            )
            result["shares"][f"{name} @ lr {lr:g}"] = shares
    sgd_ratio = ratios["sgd, bf16 nearest"]
    adam_ratio = ratios["adam, 8-bit moments, bf16 stochastic"]
    headers = ["way"] + [f"lr {lr:g}: update/ulp {a} (Adam {b})"
                         for lr, a, b in zip(lrs, sgd_ratio, adam_ratio, strict=True)]  # fmt: skip
    rows = [[name] + cells[name] for name in cells]
    md = (
        f"### Share of float32's loss reduction after {args.steps} steps "
        f"({args.seeds} seeds; weights near 1, bfloat16 ulp 2**-7)\n\n"
        + harness.table(headers, rows)
    )
    print(md)
    result["markdown"] = md
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
