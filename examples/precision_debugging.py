"""My O2 run is worse than O0: what now? Find where precision is lost, and fix just that.

A NeRF-style field (a positional encoding ``sin(2**k * pi * x)``, then an MLP) fits a 1-D
signal with fine detail. At O2 its test PSNR drops well below O0's. ``mpjax.compare`` runs the
O2 model beside float32 op by op and ranks the ops by the error each introduces: the
encoding's sin and cos, whose argument ``2**7 * pi * x`` is rounded to the half dtype.
``mpjax.find_f32_rules`` then finds the smallest set of modules to keep in float32 (here the
encoding alone, no matmul) and the run with those rules matches O0.

    python examples/precision_debugging.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax
import mpjax.flax

N_FREQS = 8


class PosEnc(nn.Module):
    """NeRF's positional encoding: x, sin(2**k pi x) and cos(2**k pi x) for k < N_FREQS."""

    @nn.compact
    def __call__(self, x):
        a = x[..., None] * (2.0 ** jnp.arange(N_FREQS)) * jnp.pi
        return jnp.concatenate([x[..., None], jnp.sin(a), jnp.cos(a)], -1).reshape(
            *x.shape[:-1], -1
        )


class Field(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = PosEnc(name="posenc")(x)
        for i in range(2):
            h = nn.relu(nn.Dense(64, name=f"dense_{i}")(h))
        return nn.Dense(1, name="out")(h)[..., 0]


def signal(x):
    x = x[..., 0]
    return (
        jnp.sin(3 * np.pi * x) + 0.5 * jnp.sin(37 * np.pi * x + 1) + 0.25 * jnp.cos(101 * np.pi * x)
    )


def load_data(seed=0):
    rng = np.random.default_rng(seed)
    x_train = jnp.asarray(rng.uniform(-1, 1, (8192, 1)), jnp.float32)
    x_test = jnp.asarray(rng.uniform(-1, 1, (4096, 1)), jnp.float32)
    return x_train, signal(x_train), x_test, signal(x_test)


def train(policy, data, rules=None, steps=3000, seed=0):
    """Trains the field under `policy` (and per-module `rules`); returns (psnr, model, params)."""
    x_train, y_train, x_test, y_test = data
    model = mpjax.flax.wrap(Field(), policy, rules=rules)
    params = model.init(jax.random.key(seed), x_train[:2])["params"]
    schedule = optax.cosine_decay_schedule(3e-3, steps)
    tx = mpjax.loss_scale(optax.adam(schedule), scale=policy.loss_scale())
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        scale = mpjax.get_loss_scale(opt_state)

        def loss_fn(p):
            return scale.scale(jnp.mean((model.apply({"params": p}, x) - y) ** 2))

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(x_train), 512)
        params, opt_state = step(params, opt_state, x_train[idx], y_train[idx])
    mse = float(jnp.mean((model.apply({"params": params}, x_test) - y_test) ** 2))
    return 10 * np.log10(1.0 / mse), model, params


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--tol", type=float, default=1e-2)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", mpjax.HardwareWarning)  # half on CPU is slow, not wrong

    data = load_data()
    x_test = data[2]
    o0 = mpjax.Policy.from_level("O0")
    o2 = mpjax.Policy.from_level("O2", args.dtype)
    psnr_o0, _, _ = train(o0, data, steps=args.steps)
    psnr_o2, model, params = train(o2, data, steps=args.steps)
    print(f"test PSNR: O0 {psnr_o0:.1f} dB, O2 {args.dtype} {psnr_o2:.1f} dB\n")

    # 1. Where is precision lost? The wrapped model already runs O2, so policy=None.
    def predict(p):
        return model.apply({"params": p}, x_test)

    report = mpjax.compare(predict, None, params)
    print(report.table(top=8), "\n")

    # 2. What is the least to keep in float32 so that the predictions stay within tol?
    found = mpjax.find_f32_rules(predict, None, params, tol=args.tol)
    print(found, "\n")

    # 3. Train again with those rules.
    psnr_fixed, _, _ = train(o2, data, rules=found.rules, steps=args.steps)
    print("| run | test PSNR (dB) |\n|---|---:|")
    print(f"| O0 float32 | {psnr_o0:.1f} |\n| O2 {args.dtype} | {psnr_o2:.1f} |")
    print(f"| O2 {args.dtype}, rules={found.rules} | {psnr_fixed:.1f} |")
    return {
        "psnr_o0": psnr_o0,
        "psnr_o2": psnr_o2,
        "psnr_fixed": psnr_fixed,
        "rules": found.rules,
        "top_module": report.modules[0].module,
        "top_op": report.rows[0].primitive,
        "prediction_error": report.error,
        "fixed_prediction_error": found.error,
        "f32_flop_share": found.f32_flop_share,
    }


if __name__ == "__main__":
    main()
