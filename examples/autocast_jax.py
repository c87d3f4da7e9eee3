"""A plain JAX function under autocast: no Flax, one ``mpjax.autocast`` call.

Trains a two-layer MLP written as a function of a params dict on scikit-learn's bundled
digits, prints the audit of the train step (which matmuls ran in which dtype) and the result.

    python examples/autocast_jax.py --level O1 --dtype bfloat16
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
from train_digits import cross_entropy, load_data  # noqa: E402

import mpjax  # noqa: E402


def mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", choices=mpjax.LEVELS, default="O1")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args(argv)

    policy = mpjax.Policy.from_level(args.level, args.dtype)
    model = mpjax.autocast(mlp, policy)  # any JAX function
    k1, k2 = jax.random.split(jax.random.key(0))
    params = policy.cast_to_param(
        {
            "w1": jax.random.normal(k1, (64, 256)) / 8,
            "b1": jnp.zeros(256),
            "w2": jax.random.normal(k2, (256, 10)) / 16,
            "b2": jnp.zeros(10),
        }
    )
    tx = mpjax.loss_scale(optax.adam(1e-3), scale=policy.loss_scale())
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        scale = mpjax.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: scale.scale(cross_entropy(model(p, x), y)))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scale.unscale(loss)

    x_train, x_test, y_train, y_test = load_data()
    print(mpjax.audit(train_step, params, opt_state, x_train[:64], y_train[:64]))
    rng = np.random.default_rng(0)
    for _ in range(args.epochs):
        order = rng.permutation(len(x_train))
        for s in range(len(x_train) // 64):
            idx = order[s * 64 : (s + 1) * 64]
            params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
    acc = float(jnp.mean(jnp.argmax(model(params, x_test), -1) == y_test))
    result = {"final_loss": float(loss), "test_accuracy": acc}
    print(f"\n{args.level} {args.dtype}: final loss {result['final_loss']:.4f}, "
          f"test accuracy {100 * acc:.2f}%")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
