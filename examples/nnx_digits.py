"""Flax NNX under a precision policy: an MLP on scikit-learn's bundled digits.

``mpjax.flax.wrap`` casts the NNX module's params to the policy's param dtype and runs its
calls under autocast; ``nnx.Optimizer`` takes ``mpjax.loss_scale(optax.adam(...))``.

    python examples/nnx_digits.py --level O2 --dtype float16
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import cross_entropy, load_data  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 256, rngs=rngs)
        self.norm = nnx.LayerNorm(256, rngs=rngs)
        self.out = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", choices=mpjax.LEVELS, default="O2")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args(argv)

    policy = mpjax.Policy.from_level(args.level, args.dtype)
    model = mpjax.flax.wrap(MLP(nnx.Rngs(0)), policy)
    optimizer = nnx.Optimizer(
        model, mpjax.loss_scale(optax.adam(1e-3), scale=policy.loss_scale()), wrt=nnx.Param
    )

    @nnx.jit
    def train_step(model, optimizer, x, y):
        scale = mpjax.get_loss_scale(optimizer.opt_state)
        loss, grads = nnx.value_and_grad(lambda m: scale.scale(cross_entropy(m(x), y)))(model)
        optimizer.update(model, grads)
        return scale.unscale(loss)

    @nnx.jit
    def accuracy(model, x, y):
        return jnp.mean(jnp.argmax(model(x), -1) == y)

    x_train, x_test, y_train, y_test = load_data()
    rng = np.random.default_rng(0)
    for _ in range(args.epochs):
        order = rng.permutation(len(x_train))
        for s in range(len(x_train) // 64):
            idx = order[s * 64 : (s + 1) * 64]
            loss = train_step(model, optimizer, x_train[idx], y_train[idx])
    metrics = {k: v.item() for k, v in mpjax.loss_scale_metrics(optimizer.opt_state).items()}
    result = {
        "policy": f"{args.level} {args.dtype}",
        "param_dtype": str(jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))[0].dtype),
        "final_loss": float(loss),
        "test_accuracy": float(accuracy(model, x_test, y_test)),
        **metrics,
    }
    for k, v in result.items():
        print(f"{k:>18}: {v}")
    return result


if __name__ == "__main__":
    main()
