"""Train a small CNN on scikit-learn's bundled digits at O0-O3, in float16 and bfloat16, and FP8.

Each run is the README's train step: a precision policy from ``mpjax.Policy.from_level``, the
Flax model wrapped by ``mpjax.flax.wrap``, ``mpjax.loss_scale(optax.sgd(..., momentum=0.9))``
(the wrap form: a skipped step leaves the momentum untouched) and ``mpjax.get_loss_scale``
inside ``jax.jit``. The FP8 run (O2 bfloat16
with FP8 dots, ``mpjax.fp8.policy("O2")``) differentiates through ``mpjax.fp8.value_and_grad``
and threads its delayed-scaling state through the step; its eligible dot (the 1024x128 Dense:
sizes that are multiples of 16) runs in FP8, the convolutions and the 10-way output in
bfloat16. At the end it prints a table (test accuracy, final loss, steps/s, the train step's
compiled temporary memory against O0's, skipped steps, final loss scale, FP8 sites) and writes
a PNG of the loss curves and loss-scale trajectories.

    python examples/train_digits.py                      # every level, both half dtypes, FP8
    python examples/train_digits.py --level O2 --dtype float16 --epochs 50
    python examples/train_digits.py --level fp8

The data ship inside scikit-learn (``load_digits``): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import mpjax
import mpjax.flax
import mpjax.fp8


class CNN(nn.Module):
    """A small CNN for 8x8 digits: two convolutions with BatchNorm, then two dense layers."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], 8, 8, 1)
        x = nn.Conv(32, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.relu(nn.Conv(64, (3, 3), strides=(2, 2))(x))
        x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


def load_data(seed: int = 0):
    """The 1,797 8x8 digits, scaled to [0, 1], split 80/20 (stratified)."""
    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def cross_entropy(logits, labels):
    # The loss runs outside the model, on float32 logits (the model's output dtype at O0-O2).
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def pad16(x):
    """`x` with zero rows appended up to a multiple of 16 rows (FP8 dots need such sizes)."""
    return jnp.pad(x, [(0, -len(x) % 16)] + [(0, 0)] * (x.ndim - 1))


def train(level: str, half: str, epochs: int, batch: int, lr: float, seed: int, data, bar: bool):
    fp8 = level == "fp8"
    # FP8: the wrapper runs the base policy (O2 bfloat16); value_and_grad runs the dots in FP8.
    policy = mpjax.fp8.policy("O2", half) if fp8 else mpjax.Policy.from_level(level, half)
    base = policy.base if fp8 else policy
    model = mpjax.flax.wrap(CNN(), policy)  # params in param_dtype, ops per the level
    tx = mpjax.loss_scale(optax.sgd(lr, momentum=0.9), scale=base.loss_scale())
    x_train, x_test, y_train, y_test = data
    variables = model.init(jax.random.key(seed), x_train[:1])
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)

    def loss_fn(p, stats, scale, x, y):
        logits, updates = model.apply(
            {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
        )
        return scale.scale(cross_entropy(logits, y)), updates["batch_stats"]

    def predict(params, stats, x):
        return model.apply({"params": params, "batch_stats": stats}, x)

    scale0 = mpjax.get_loss_scale(opt_state)
    # The FP8 state (scales and amax histories of each FP8 dot) lives beside the optimizer.
    fp8_state = (
        mpjax.fp8.init(loss_fn, policy, params, stats, scale0, x_train[:batch], y_train[:batch])
        if fp8
        else None
    )

    @jax.jit
    def train_step(params, stats, opt_state, fp8_state, x, y):
        scale = mpjax.get_loss_scale(opt_state)
        if fp8:
            grad_fn = mpjax.fp8.value_and_grad(loss_fn, policy, has_aux=True)
            (loss, stats), grads, fp8_state = grad_fn(fp8_state, params, stats, scale, x, y)
        else:
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, stats), grads = grad_fn(params, stats, scale, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        metrics = mpjax.loss_scale_metrics(opt_state)
        params = optax.apply_updates(params, updates)
        return params, stats, opt_state, fp8_state, scale.unscale(loss), metrics

    @jax.jit
    def accuracy(params, stats, fp8_state, x, y):
        if fp8:  # evaluated in FP8 too, at the trained scales (rows padded to 16, then cut)
            logits = mpjax.fp8.apply(predict, policy)(fp8_state, params, stats, pad16(x))
            logits = logits[: len(y)]
        else:
            logits = predict(params, stats, x)
        return jnp.mean(jnp.argmax(logits, -1) == y)

    rng = np.random.default_rng(seed)
    steps_per_epoch = len(x_train) // batch
    losses, scales = [], []
    name = "FP8 O2 bfloat16" if fp8 else f"{level} {half}" if level != "O0" else "O0 float32"
    # Compile before the timed loop (the results are thrown away: the run starts at step 0).
    first = (params, stats, opt_state, fp8_state, x_train[:batch], y_train[:batch])
    compiled = train_step.lower(*first).compile()
    # XLA's buffers for activations, residuals and gradients: what mixed precision shrinks.
    temp_bytes = int(compiled.memory_analysis().temp_size_in_bytes)
    jax.block_until_ready(train_step(*first))
    start = time.perf_counter()
    for _ in tqdm(range(epochs), desc=f"{name:>15}", disable=not bar, leave=True):
        order = rng.permutation(len(x_train))
        for s in range(steps_per_epoch):
            idx = order[s * batch : (s + 1) * batch]
            params, stats, opt_state, fp8_state, loss, metrics = train_step(
                params, stats, opt_state, fp8_state, x_train[idx], y_train[idx]
            )
            losses.append(loss)
            scales.append(metrics["loss_scale"])
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    losses = [float(v) for v in losses]
    metrics = {k: v.item() for k, v in mpjax.loss_scale_metrics(opt_state).items()}
    tail = max(1, steps_per_epoch)
    return {
        "run": name,
        "level": level,
        "dtype": half if level != "O0" else "float32",
        "test_accuracy": float(accuracy(params, stats, fp8_state, x_test, y_test)),
        "fp8_sites": fp8_state.num_sites if fp8 else 0,
        "final_loss": float(np.mean(losses[-tail:])),
        "steps_per_s": len(losses) / seconds,
        "temp_bytes": temp_bytes,
        "skipped_steps": int(metrics["skipped_steps"]),
        "final_loss_scale": float(metrics["loss_scale"]),
        "losses": losses,
        "loss_scales": [float(v) for v in scales],
    }


def table(results) -> str:
    o0 = next((r["temp_bytes"] for r in results if r["level"] == "O0"), None)
    head = (
        "| run | test acc | final loss | steps/s | step memory (KiB) | vs O0 | skipped "
        "| final scale | FP8 sites |"
    )
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        vs = f"{r['temp_bytes'] / o0:.2f}" if o0 else "-"
        rows.append(
            f"| {r['run']} | {100 * r['test_accuracy']:.2f}% | {r['final_loss']:.4f} | "
            f"{r['steps_per_s']:.0f} | {r['temp_bytes'] / 1024:.0f} | {vs} | "
            f"{r['skipped_steps']} | {r['final_loss_scale']:g} | {r['fp8_sites']} |"
        )
    return "\n".join(rows) + (
        "\n\nstep memory: the jitted train step's temporary buffers (XLA's memory_analysis: "
        "activations, residuals saved for the backward pass, gradients), not params or data."
    )


def plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        k = 10
        smooth = np.convolve(r["losses"], np.ones(k) / k, mode="valid")
        ax_loss.plot(smooth, label=r["run"], lw=1)
        ax_scale.plot(r["loss_scales"], label=r["run"], lw=1)
    ax_loss.set(title="training loss (10-step mean)", xlabel="step", yscale="log")
    ax_scale.set(title="loss scale", xlabel="step", yscale="log")
    ax_loss.legend(fontsize=8)
    ax_scale.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", choices=[*mpjax.LEVELS, "fp8", "all"], default="all")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "both"], default="both")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("examples", "out"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-bar", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)

    levels = (*mpjax.LEVELS, "fp8") if args.level == "all" else (args.level,)
    halves = ("float16", "bfloat16") if args.dtype == "both" else (args.dtype,)
    # FP8 runs on a bfloat16 base (the FP8 training convention), whatever --dtype says.
    runs = [
        (lv, h)
        for lv in levels
        for h in (("bfloat16",) if lv == "fp8" else halves if lv != "O0" else halves[:1])
    ]
    data = load_data(args.seed)
    print(
        f"jax {jax.__version__} on {jax.default_backend()}; {len(data[0])} train, "
        f"{len(data[1])} test digits; {args.epochs} epochs of batch {args.batch}"
    )
    results = [
        train(lv, h, args.epochs, args.batch, args.lr, args.seed, data, not args.no_bar)
        for lv, h in runs
    ]
    print()
    print(table(results))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "digits_results.json"), "w") as f:
        json.dump(results, f)
    if not args.no_plot:
        path = os.path.join(args.out, "digits_loss.png")
        plot(results, path)
        print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()
