"""FP8's accuracy on the benchmark's Transformer: its loss after N Adam steps against mpjax O2
bfloat16's, over several initializations (seeds), so the gap is read against seed noise.

    python benchmarks/fp8_accuracy.py                      # small Transformer, 100 steps, 3 seeds
    python benchmarks/fp8_accuracy.py --size tiny --steps 50 --seeds 2

Each seed initializes the float32 Transformer LM of ``models.py`` with its own key and trains
it on the benchmark's fixed batch (next-token prediction), once per variant, with the same
Adam as ``models.py``: O2 bfloat16 (``mpjax.flax.wrap``), FP8 with delayed scaling (the
default, ``mpjax.fp8.policy("O2")``) and FP8 with current scaling per tensor. On a CPU the
FP8 dots are emulated (the same float8 roundings, no FP8 gemm): the numbers are the GPU's.
FP8 is within seed noise when its mean final loss is within two standard deviations of the
seeds' O2 bfloat16 losses.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import models  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402
import mpjax.fp8  # noqa: E402

VARIANTS = ("O2 bfloat16", "FP8 delayed (default)", "FP8 current")


def train(variant: str, seed: int, size: str, steps: int) -> list[float]:
    """The loss at each step of one run."""
    module, x, y, _ = models.build("transformer", size)
    tx = optax.adam(1e-3)
    if variant == "O2 bfloat16":
        model = mpjax.flax.wrap(module, mpjax.Policy.from_level("O2", "bfloat16"))
        params = model.init(jax.random.key(seed), x)["params"]
        fn = functools.partial(models.loss_and_stats, model, "default")

        @jax.jit
        def step(params, opt_state):
            (loss, _), grads = jax.value_and_grad(fn, has_aux=True)(params, {}, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        state = (params, tx.init(params))
        losses = []
        for _ in range(steps):
            *state, loss = step(*state)
            losses.append(float(loss))
        return losses
    recipe = mpjax.fp8.CurrentScaling() if variant == "FP8 current" else None
    policy = mpjax.fp8.policy("O2", recipe=recipe)
    params = module.init(jax.random.key(seed), x)["params"]
    fn = functools.partial(models.loss_and_stats, module, "default")
    fp8_state = mpjax.fp8.init(fn, policy, params, {}, x, y)
    grad = mpjax.fp8.scaled_value_and_grad(fn, policy, has_aux=True)

    @jax.jit
    def fp8_step(params, opt_state, fp8_state):
        (loss, _), grads, fp8_state = grad(fp8_state, params, {}, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, fp8_state, loss

    state = (params, tx.init(params), fp8_state)
    losses = []
    for _ in range(steps):
        *state, loss = fp8_step(*state)
        losses.append(float(loss))
    return losses


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    final: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for seed in range(args.seeds):
        for variant in VARIANTS:
            losses = train(variant, seed, args.size, args.steps)
            final[variant].append(losses[-1])
            print(f"  seed {seed} {variant}: {losses[0]:.4f} -> {losses[-1]:.4f}", file=sys.stderr)
    base = final["O2 bfloat16"]
    mean0, sd0 = statistics.mean(base), statistics.stdev(base) if len(base) > 1 else 0.0
    rows = []
    for variant in VARIANTS:
        mean = statistics.mean(final[variant])
        sd = statistics.stdev(final[variant]) if len(final[variant]) > 1 else 0.0
        within = abs(mean - mean0) <= 2 * sd0
        rows.append([variant, f"{mean:.4f} ± {sd:.4f}", f"{mean - mean0:+.4f}",
                     "yes" if within else "no"])  # fmt: skip
    info = harness.machine()
    md = (
        f"### FP8 accuracy: Transformer ({args.size}), {args.steps} Adam steps, "
        f"{args.seeds} seeds ({info['device']}, jax {info['jax']})\n\n"
        + harness.table(
            [
                "variant",
                "final loss (mean ± sd over seeds)",
                "vs O2 bfloat16",
                "within 2 sd of O2 bfloat16's seeds",
            ],
            rows,
        )  # fmt: skip
    )
    print(md)
    result = {"machine": info, "config": vars(args), "final": final, "markdown": md}
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
