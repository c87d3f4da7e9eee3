"""Tracing + compiling cost of an autocast train step against the plain step.

For a Flax Transformer block and a ResNet-style CNN, builds the jitted train step three ways
and times ``jit(step).lower(...).compile()`` from scratch (a fresh function each time, so no
cache is hit), interleaved round by round:

- plain:    the float32 model, no mixed precision;
- flax-dtype: the same model with Flax's own ``dtype=`` set to the half dtype (the usual
  hand-written mixed precision);
- autocast: ``mpjax.flax.wrap(model, Policy.from_level(level))``.

Reports the median time of each, the median paired ratio autocast / plain (target <= 1.3),
and autocast / flax-dtype, which isolates mpjax's own cost from the compiler's cost of half
precision itself.

    python benchmarks/compile_overhead.py --level O2 --dtype bfloat16 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402


class Block(nn.Module):
    dtype: object = None
    width: int = 256

    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            h = nn.LayerNorm(dtype=self.dtype)(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4, dtype=self.dtype)(h, h)
            h = nn.LayerNorm(dtype=self.dtype)(x)
            x = x + nn.Dense(self.width, dtype=self.dtype)(
                nn.gelu(nn.Dense(4 * self.width, dtype=self.dtype)(h))
            )
        return nn.Dense(10, dtype=self.dtype)(x.mean(axis=1))


class CNN(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        for width in (32, 64, 128):
            y = nn.Conv(width, (3, 3), dtype=self.dtype)(x)
            y = nn.BatchNorm(use_running_average=True, dtype=self.dtype)(y)
            y = nn.relu(y)
            y = nn.Conv(width, (3, 3), dtype=self.dtype)(y)
            x = nn.relu(y + nn.Conv(width, (1, 1), dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x.mean(axis=(1, 2)))


def build(kind: str, variant: str, policy: mpjax.Policy):
    cls, shape = {"transformer": (Block, (8, 32, 256)), "cnn": (CNN, (8, 32, 32, 3))}[kind]
    x = jnp.ones(shape)
    y = jnp.zeros((shape[0],), jnp.int32)
    dtype = policy.compute_dtype if variant == "flax-dtype" else None
    module = cls(dtype=dtype)
    model = mpjax.flax.wrap(module, policy) if variant == "autocast" else module
    variables = model.init(jax.random.key(0), x)
    tx = mpjax.loss_scale(optax.adam(1e-3), scale=policy.loss_scale())
    opt_state = tx.init(variables["params"])

    def step(params, opt_state):
        scale = mpjax.get_loss_scale(opt_state)

        def loss_fn(p):
            logits = model.apply({**variables, "params": p}, x).astype(jnp.float32)
            return scale.scale(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, (variables["params"], opt_state)


def time_compile(kind: str, variant: str, policy: mpjax.Policy) -> float:
    step, args = build(kind, variant, policy)
    start = time.perf_counter()
    jax.jit(step).lower(*args).compile()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", default="O2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    policy = mpjax.Policy.from_level(args.level, args.dtype)
    variants = ("plain", "flax-dtype", "autocast")
    result: dict = {
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "policy": f"{args.level} {args.dtype}",
        "models": {},
    }
    print(f"jax {jax.__version__} on {jax.default_backend()}; {args.level} {args.dtype}")
    print(
        "| model | plain (s) | flax dtype= (s) | autocast (s) | autocast / plain | <= 1.3 "
        "| autocast / flax dtype= |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for kind in ("transformer", "cnn"):
        time_compile(kind, "autocast", policy)  # warm up imports and caches of jax itself
        # Interleaved by hand: each call times only its own lower + compile, not the init.
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                times[v].append(time_compile(kind, v, policy))
        ratio = harness.paired_ratio(times, "autocast", "plain")
        vs_flax = harness.paired_ratio(times, "autocast", "flax-dtype")
        med = {v: statistics.median(t) for v, t in times.items()}
        result["models"][kind] = {
            "median_s": med,
            "autocast_over_plain": ratio,
            "autocast_over_flax_dtype": vs_flax,
        }
        print(
            f"| {kind} | {med['plain']:.2f} | {med['flax-dtype']:.2f} | {med['autocast']:.2f} "
            f"| {ratio:.2f} | {'met' if ratio <= 1.3 else 'NOT met'} | {vs_flax:.2f} |"
        )
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
