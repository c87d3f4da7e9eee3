"""Loss-scaling overhead: the same jitted train step with NoOp, Static and Dynamic loss scales.

All variants run in one process, interleaved round by round, and each round's time is divided
by the NoOp step's time in the same round; the table reports the median of those paired
ratios (machines are noisy, so only side-by-side ratios mean anything).

    python benchmarks/loss_scale_overhead.py                 # small MLP, CPU-sized
    python benchmarks/loss_scale_overhead.py --width 4096 --batch 1024 --level O2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import mpjax  # noqa: E402


def init(key, width: int, depth: int, policy: mpjax.Policy):
    keys = jax.random.split(key, depth)
    return policy.cast_to_param(
        [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys]
    )


def loss_fn(params, x, y, policy: mpjax.Policy):
    h = policy.cast_to_compute(x)
    for w in policy.cast_to_compute(params):
        h = jax.nn.relu(h @ w)
    return jnp.mean((h.astype(jnp.float32) - y) ** 2)


def make_step(tx, policy):
    def step(params, opt_state, x, y):
        scale = mpjax.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y, policy)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--level", default="O2")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    policy = mpjax.Policy.from_level(args.level, args.dtype)
    key = jax.random.key(0)
    x = jax.random.normal(key, (args.batch, args.width))
    y = jax.random.normal(jax.random.key(1), (args.batch, args.width))
    scales = {
        "noop": mpjax.NoOpLossScale(),
        "static": mpjax.StaticLossScale(2.0**10),
        "dynamic": mpjax.DynamicLossScale(2.0**10),
        "dynamic+hysteresis": mpjax.DynamicLossScale(2.0**10, hysteresis=2),
    }
    variants = {}
    for name, scale in scales.items():
        tx = optax.chain(mpjax.loss_scale(scale=scale), optax.sgd(1e-3))
        params = init(key, args.width, args.depth, policy)
        state = (params, tx.init(params))
        step = make_step(tx, policy)
        state = step(*state, x, y)  # compile
        jax.block_until_ready(state)
        variants[name] = [step, state]

    def runner(name: str):
        def run():
            step, state = variants[name]
            for _ in range(args.steps):
                state = step(*state, x, y)
            variants[name][1] = state
            return state

        return run

    times = harness.interleave({name: runner(name) for name in variants}, args.rounds)
    times = {k: [t / args.steps for t in v] for k, v in times.items()}
    ratios = {name: harness.paired_ratio(times, name, "noop") for name in times}
    result = {
        "machine": harness.machine(),
        "config": vars(args),
        "median_step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "ratio_to_noop": ratios,
    }
    print(
        f"{result['machine']['device']} ({result['machine']['backend']}), jax {jax.__version__}; "
        f"{args.level} {args.dtype}, {args.depth}x{args.width} MLP, batch {args.batch}"
    )
    print("| loss scale | median step (ms) | paired ratio to NoOp |")
    print("|---|---:|---:|")
    for name in variants:
        print(f"| {name} | {result['median_step_ms'][name]:.3f} | {ratios[name]:.3f} |")
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
