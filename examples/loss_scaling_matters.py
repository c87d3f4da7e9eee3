"""Why loss scaling matters: float16 gradients underflow without it.

Trains the digits CNN of ``train_digits.py`` three ways, with Adam (which does not care about
the loss's scale, so float32 trains the same at any loss weight):

- O0 float32: the reference;
- O2 float16 with no loss scaling;
- O2 float16 with mpjax's dynamic loss scale.

The loss carries a weight of 2**-20, which puts its gradients where a large model's live
(Micikevicius et al. 2018 found most activation gradients of real networks below float16's
smallest normal number, 2**-14); a real model gets there through depth, width and averaging.
It prints, for each run, the share of gradient entries that came out exactly zero, the final
loss and the test accuracy.

    python examples/loss_scaling_matters.py --epochs 10
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
from train_digits import CNN, cross_entropy, load_data  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402

WEIGHT = 2.0**-20


def run(name: str, policy: mpjax.Policy, scale, epochs: int, data, seed: int = 0) -> dict:
    x_train, x_test, y_train, y_test = data
    model = mpjax.flax.wrap(CNN(), policy)
    variables = model.init(jax.random.key(seed), x_train[:1])
    params, stats = variables["params"], variables["batch_stats"]
    tx = mpjax.loss_scale(optax.adam(1e-3), scale=scale)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, stats, opt_state, x, y):
        ls = mpjax.get_loss_scale(opt_state)

        def loss_fn(p):
            logits, new = model.apply(
                {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return ls.scale(WEIGHT * cross_entropy(logits, y)), new["batch_stats"]

        grads, stats = jax.grad(loss_fn, has_aux=True)(params)
        leaves = jax.tree_util.tree_leaves(grads)
        zeros = sum(jnp.sum(g == 0) for g in leaves) / sum(g.size for g in leaves)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, zeros

    @jax.jit
    def evaluate(params, stats, x, y):
        logits = model.apply({"params": params, "batch_stats": stats}, x)
        return cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

    rng = np.random.default_rng(seed)
    batch, zero_shares = 64, []
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for s in range(len(x_train) // batch):
            idx = order[s * batch : (s + 1) * batch]
            params, stats, opt_state, zeros = step(
                params, stats, opt_state, x_train[idx], y_train[idx]
            )
            zero_shares.append(float(zeros))
    loss, acc = evaluate(params, stats, x_test, y_test)
    metrics = mpjax.loss_scale_metrics(opt_state)
    return {
        "run": name,
        "zero_gradient_share": float(np.mean(zero_shares)),
        "test_loss": float(loss),
        "test_accuracy": float(acc),
        "final_loss_scale": float(metrics["loss_scale"]),
        "skipped_steps": int(metrics["skipped_steps"]),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    data = load_data()
    o2 = mpjax.Policy.from_level("O2", "float16")
    results = [
        run("O0 float32", mpjax.Policy.from_level("O0"), mpjax.NoOpLossScale(), args.epochs, data),
        run("O2 float16, no loss scaling", o2, mpjax.NoOpLossScale(), args.epochs, data),
        run("O2 float16, dynamic loss scale", o2, mpjax.DynamicLossScale(2.0**15, period=200),
            args.epochs, data),
    ]  # fmt: skip
    print(f"loss weight {WEIGHT:g}; Adam; {args.epochs} epochs\n")
    print("| run | zero gradients | test loss | test accuracy | final scale | skipped |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['run']} | {100 * r['zero_gradient_share']:.1f}% | {r['test_loss']:.4f} | "
            f"{100 * r['test_accuracy']:.2f}% | {r['final_loss_scale']:g} | {r['skipped_steps']} |"
        )
    return results


if __name__ == "__main__":
    main()
