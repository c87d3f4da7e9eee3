"""Train a small CNN on scikit-learn's bundled digits at O0-O3, in float16 and bfloat16, and FP8;
show what each level buys on this machine and why float16 needs a loss scale.

Each run is the README's train step: a precision policy from ``mpjax.Policy.from_level``, the
Flax model wrapped by ``mpjax.flax.wrap``, ``mpjax.loss_scale(optax.sgd(..., momentum=0.9))``
(the wrap form: a skipped step leaves the params and the momentum untouched) and
``mpjax.get_loss_scale`` inside ``jax.jit``. The FP8 run (O2 bfloat16 with FP8 dots,
``mpjax.fp8.policy("O2")``) differentiates through ``mpjax.fp8.scaled_value_and_grad`` and
threads its delayed-scaling state through the step; its eligible dot (the 1024x128 Dense:
sizes that are multiples of 16) runs in FP8, the convolutions and the 10-way output in bfloat16.

The loss scale. Where a level implies one (float16 at O1 and O2) the runs use
``mpjax.DynamicLossScale(2.0**24, period=40)`` rather than the default ``(2.0**15,
period=2000)``, under which a 440-step run would never see the scale move. Starting at the
2**24 cap, the first steps overflow float16: each is skipped and the scale halves, until it
fits; then it doubles after every 40 finite steps as the gradients shrink, back to the cap.
bfloat16 needs no scale (it has float32's exponent range), nor do O0 and O3 (half params, as
apex O3), so those runs have none.

Why float16 needs it at all. This CNN's gradients are large: float16 trains without a scale
here ("O2 float16, no scale"), losing only some gradient entries to underflow. A large model's
are not: Micikevicius et al. (2018) found most activation gradients of real networks below
float16's smallest normal number, 2**-14. So the loss-scaling runs also multiply the loss by
2**-20 and the learning rate by 2**20. That is the same training in exact arithmetic, and in
float32 bit for bit, since powers of two scale exactly ("O0 float32, loss x2^-20" reproduces
O0's loss history); only the gradients are 2**20 times smaller, where a large model's live.
Without a scale every float16 gradient entry then underflows to zero and the model stays at
chance; with the dynamic scale it trains as float32 does.

It prints a table of the level runs (test accuracy, final loss, steps/s, the train step's compiled
temporary memory against O0's, the params and optimizer state, the loss scale's range, skipped
steps, FP8 sites), a one-line verdict per level computed from those numbers, and a table of the
loss-scaling runs (share of gradient entries that are exactly zero, accuracy); it writes
``digits_results.json`` (every number, with per-step losses, loss scales, skipped steps and
zero-gradient shares) and ``digits_loss.png``.

    python examples/train_digits.py                      # every level, both half dtypes, FP8
    python examples/train_digits.py --level O2 --dtype float16 --epochs 50
    python examples/train_digits.py --level fp8

The data ship inside scikit-learn (``load_digits``): nothing is downloaded. Progress bars are
drawn only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
import warnings

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

# The loss weight of the loss-scaling runs: gradients where a large model's live. A power of
# two, so that float32 training is bit-identical to the unweighted run.
WEIGHT = 2.0**-20


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


def pow2(value: float) -> str:
    """`value` as ``2^k`` when it is a power of two, else as ``%g``."""
    k = math.log2(value) if value > 0 else 0.5
    return f"2^{int(k)}" if k == int(k) else f"{value:g}"


def scale_kind(scale) -> str:
    """``"dynamic"``, ``"static"`` or ``"none"`` for a loss scale."""
    if isinstance(scale, mpjax.DynamicLossScale):
        return "dynamic"
    return "static" if isinstance(scale, mpjax.StaticLossScale) else "none"


# --fp8-recipe: Hopper's default, or Blackwell's block recipes (emulated off a B200)
RECIPES = {
    "delayed": ("FP8", mpjax.fp8.DelayedScaling()),
    "mxfp8": ("MXFP8", mpjax.fp8.MXFP8BlockScaling()),
    "nvfp4": ("NVFP4", mpjax.fp8.NVFP4BlockScaling()),
}


def run_name(level: str, half: str, recipe: str = "delayed") -> str:
    if level == "fp8":
        return f"{RECIPES[recipe][0]} O2 {half}"
    return "O0 float32" if level == "O0" else f"{level} {half}"


def train(
    level: str,
    half: str,
    epochs: int,
    batch: int,
    lr: float,
    seed: int,
    data,
    bar: bool = False,
    *,
    scale=None,
    loss_weight: float = 1.0,
    name: str | None = None,
    count_zeros: bool = False,
    recipe: str = "delayed",
) -> dict:
    """Trains one run; returns its numbers and per-step histories (JSON-ready).

    Args:
      level: ``"O0"``..``"O3"``, or ``"fp8"`` (O2 with FP8 dots, on a `half` base).
      half: the half dtype, ``"float16"`` or ``"bfloat16"`` (ignored at O0).
      epochs, batch, lr, seed: the schedule (SGD with momentum 0.9, reshuffled every epoch).
      data: ``load_data()``'s four arrays.
      bar: draw a tqdm bar (only when stderr is a terminal).
      scale: the loss scale; None for the one the level implies (``policy.loss_scale()``).
      loss_weight: multiplies the loss and divides the learning rate (module docstring).
      name: the run's name in the tables and the plot.
      count_zeros: also log, each step, the share of gradient entries that are exactly zero.
        Reading the gradients twice keeps them alive longer, so such a run reports no step
        memory (``temp_bytes`` is None).
      recipe: the FP8 level's recipe, a key of ``RECIPES``.
    """
    fp8 = level == "fp8"
    # FP8: the wrapper runs the base policy (O2 bfloat16); scaled_value_and_grad runs the dots
    # in FP8.
    policy = (
        mpjax.fp8.policy("O2", half, recipe=RECIPES[recipe][1])
        if fp8
        else mpjax.Policy.from_level(level, half)
    )
    base = policy.base if fp8 else policy
    scale = base.loss_scale() if scale is None else scale
    model = mpjax.flax.wrap(CNN(), policy)  # params in param_dtype, ops per the level
    tx = mpjax.loss_scale(optax.sgd(lr / loss_weight, momentum=0.9), scale=scale)
    x_train, x_test, y_train, y_test = data
    variables = model.init(jax.random.key(seed), x_train[:1])
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)

    def loss_fn(p, stats, scale, x, y):
        logits, updates = model.apply(
            {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
        )
        loss = cross_entropy(logits, y)
        return scale.scale(loss_weight * loss), (updates["batch_stats"], loss)

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
            grad_fn = mpjax.fp8.scaled_value_and_grad(loss_fn, policy, has_aux=True)
            (_, (stats, loss)), grads, fp8_state = grad_fn(fp8_state, params, stats, scale, x, y)
        else:
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (_, (stats, loss)), grads = grad_fn(params, stats, scale, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        log = {
            "loss": loss,  # the cross-entropy itself, before the weight and the scale
            "scale": jnp.asarray(scale.loss_scale, jnp.float32),  # the scale this step ran at
            "finite": mpjax.loss_scale_metrics(opt_state)["last_step_finite"],
        }
        if count_zeros:  # float16 underflow shows up here (and dead ReLUs)
            leaves = jax.tree_util.tree_leaves(grads)
            log["zeros"] = sum(jnp.sum(g == 0) for g in leaves) / sum(g.size for g in leaves)
        return optax.apply_updates(params, updates), stats, opt_state, fp8_state, log

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
    name = name or run_name(level, half, recipe)
    # Compile before the timed loop; the warm-up step's results are thrown away.
    first = (params, stats, opt_state, fp8_state, x_train[:batch], y_train[:batch])
    step = train_step.lower(*first).compile()
    # XLA's buffers for activations, residuals and gradients: what mixed precision shrinks.
    temp_bytes = None if count_zeros else int(step.memory_analysis().temp_size_in_bytes)
    # What lives between steps: params, BatchNorm statistics, optimizer (and FP8) state.
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(first[:4]))
    jax.block_until_ready(step(*first))
    logs, epoch_seconds = [], []
    # Bars only on a terminal: a log file would get a flood of carriage returns.
    show = bar and sys.stderr.isatty()
    for _ in tqdm(range(epochs), desc=f"{name:>38}", disable=not show, leave=True):
        start = time.perf_counter()
        order = rng.permutation(len(x_train))
        for s in range(steps_per_epoch):
            idx = order[s * batch : (s + 1) * batch]
            params, stats, opt_state, fp8_state, log = step(
                params, stats, opt_state, fp8_state, x_train[idx], y_train[idx]
            )
            logs.append(log)
        jax.block_until_ready(params)
        epoch_seconds.append(time.perf_counter() - start)
    hist = {k: np.asarray([log[k] for log in jax.device_get(logs)]) for k in logs[0]}
    kind = scale_kind(scale)
    scales = hist["scale"].astype(float)
    skipped_at = np.flatnonzero(~hist["finite"]).tolist()
    config = None
    if kind == "dynamic":
        config = {"initial": float(scale.loss_scale), "period": scale.period}
        config |= {"max": scale.max_loss_scale, "min": scale.min_loss_scale}
    elif kind == "static":
        config = {"value": scale.loss_scale}
    return {
        "run": name,
        "level": level,
        "dtype": half if level != "O0" else "float32",
        "recipe": recipe if fp8 else None,
        "loss_weight": loss_weight,
        "test_accuracy": float(accuracy(params, stats, fp8_state, x_test, y_test)),
        "fp8_sites": fp8_state.num_sites if fp8 else 0,
        "final_loss": float(np.mean(hist["loss"][-steps_per_epoch:])),
        # The fastest epoch, as timeit takes the best: the one least disturbed by other work.
        "steps_per_s": steps_per_epoch / min(epoch_seconds),
        "epoch_seconds": epoch_seconds,
        "temp_bytes": temp_bytes,
        "state_bytes": int(state_bytes),
        "loss_scaling": kind,
        "scale_config": config,
        "skipped_steps": len(skipped_at),
        "skipped_at": skipped_at,
        "scale_growths": int(np.sum(np.diff(scales) > 0)),
        "scale_backoffs": int(np.sum(np.diff(scales) < 0)),
        "final_loss_scale": (
            float(mpjax.get_loss_scale(opt_state).loss_scale) if kind != "none" else None
        ),
        "losses": hist["loss"].astype(float).tolist(),
        # The scale each step ran at (a skipped step ran at the scale that overflowed).
        "loss_scales": scales.tolist() if kind != "none" else None,
        "zero_grad_share": float(np.mean(hist["zeros"])) if count_zeros else None,
        "zero_grad_shares": hist["zeros"].astype(float).tolist() if count_zeros else None,
    }


def scale_cell(r) -> str:
    if r["loss_scaling"] == "none":
        return "none"
    lo, hi = min(r["loss_scales"]), max(r["loss_scales"])
    end = pow2(r["final_loss_scale"])
    return end if lo == hi else f"{pow2(lo)}..{pow2(hi)}, end {end}"


def is_level_run(r) -> bool:
    """Whether `r` is one of the level runs (not one of the loss-scaling runs)."""
    recipe = r.get("recipe") or "delayed"
    return r["loss_weight"] == 1.0 and r["run"] == run_name(r["level"], r["dtype"], recipe)


def table(results) -> str:
    """The level runs as a Markdown table, with a footnote on what the columns count."""
    runs = [r for r in results if is_level_run(r)]
    o0 = next((r for r in runs if r["level"] == "O0"), None)
    rows = [
        "| run | test acc | final loss | steps/s | step memory (KiB) | vs O0 "
        "| params+opt state (KiB) | loss scale | skipped | FP8 sites |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in runs:
        vs = f"{r['temp_bytes'] / o0['temp_bytes']:.2f}" if o0 else "-"
        rows.append(
            f"| {r['run']} | {100 * r['test_accuracy']:.2f}% | {r['final_loss']:.4f} | "
            f"{r['steps_per_s']:.0f} | {r['temp_bytes'] / 1024:.0f} | {vs} | "
            f"{r['state_bytes'] / 1024:.0f} | {scale_cell(r)} | {r['skipped_steps']} | "
            f"{r['fp8_sites']} |"
        )
    notes = [
        "steps/s: the fastest epoch. step memory: the jitted train step's temporary buffers "
        "(XLA's memory_analysis:",
        "activations, residuals saved for the backward pass, gradients). params+opt state: "
        "what lives between steps.",
    ]
    if jax.default_backend() == "cpu":
        notes.append(
            "On CPU, XLA computes half dots and convolutions in float32 (it converts their "
            "operands): the half levels run\nslower there and save memory only where half "
            "values are stored. GPUs and TPUs run them in half."
        )
    return "\n".join(rows) + "\n\n" + "\n".join(notes)


def scaling_table(results) -> str:
    """The loss-scaling runs as a Markdown table."""
    rows = [
        "| run | zero gradient entries | test acc | final loss | loss scale | skipped |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for r in results:
        if r["zero_grad_share"] is not None:
            rows.append(
                f"| {r['run']} | {100 * r['zero_grad_share']:.1f}% | "
                f"{100 * r['test_accuracy']:.2f}% | {r['final_loss']:.4f} | {scale_cell(r)} | "
                f"{r['skipped_steps']} |"
            )
    return "\n".join(rows)


def verdict(r, o0, backend: str) -> str:
    """One line on what run `r` bought against `o0` on this machine, from the measured numbers."""
    speed = r["steps_per_s"] / o0["steps_per_s"]
    temp = r["temp_bytes"] / o0["temp_bytes"] - 1
    state = r["state_bytes"] / o0["state_bytes"] - 1
    points = 100 * (r["test_accuracy"] - o0["test_accuracy"])
    # Timing on a shared machine is noisy: claim a speed-up only past 10%.
    gains = [f"{speed:.1f}x speed"] if speed >= 1.1 else []
    gains += [f"{-temp:.0%} less step memory"] if temp <= -0.05 else []
    gains += [f"{-state:.0%} less params+opt state"] if state <= -0.05 else []
    why = f" ({backend}: no fast half math)" if backend == "cpu" and speed < 1.1 else ""
    if points == 0:
        accuracy = "same test accuracy"
    elif abs(points) < 0.5:
        accuracy = f"test accuracy within {abs(points):.1f} pt"
    else:
        accuracy = f"test accuracy {points:+.1f} pt"
    parts = [
        f"{speed:.2f}x O0's speed{why}",
        f"{temp:+.0%} step memory",
        f"{state:+.0%} params+opt state" if abs(state) >= 0.005 else "same params+opt state",
        accuracy,
    ]
    if r["skipped_steps"]:
        parts.append(f"{r['skipped_steps']} of {len(r['losses'])} steps skipped by the scale")
    bought = ", ".join(gains) if gains else "nothing"
    return f"{r['run']}: bought {bought} on this {backend}: " + ", ".join(parts)


def add_verdicts(results, backend: str) -> list[str]:
    """Sets the ``verdict`` of each level run but O0 and returns the lines."""
    runs = [r for r in results if is_level_run(r)]
    o0 = next((r for r in runs if r["level"] == "O0"), None)
    for r in runs:
        if o0 is not None and r is not o0:
            r["verdict"] = verdict(r, o0, backend)
    return [r["verdict"] for r in runs if "verdict" in r]


# A colour per level and a line style per dtype, so that no series hides another.
COLORS = {"O0": "black", "O1": "tab:blue", "O2": "tab:orange", "O3": "tab:green"}
COLORS["fp8"] = "tab:purple"
DASHES = {"float32": "-", "float16": "-", "bfloat16": "--"}
MARKERS = {"O0": None, "O1": "o", "O2": "s", "O3": "^", "fp8": "D"}


def smooth(values, k: int = 10):
    values = np.asarray(values, float)
    return np.convolve(values, np.ones(k) / k, mode="valid") if len(values) > k else values


def plot(results, path: str, title: str = "") -> None:
    """Writes the figure: loss per level, the float16 loss scale, and why float16 needs it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    levels = [r for r in results if is_level_run(r)]
    study = [r for r in results if r["zero_grad_share"] is not None]
    rows = 2 if study else 1
    fig, axes = plt.subplots(rows, 2, figsize=(14, 5.4 * rows + 0.6), squeeze=False)
    ax_loss, ax_scale = axes[0]

    for i, r in enumerate(levels):
        o0 = r["level"] == "O0"
        # Runs that train alike draw one line over another: markers (staggered) tell them apart.
        ax_loss.plot(
            smooth(r["losses"]), label=r["run"], color=COLORS[r["level"]],
            ls=":" if r["level"] == "fp8" else DASHES[r["dtype"]], lw=2.6 if o0 else 1.2,
            alpha=0.45 if o0 else 1.0, zorder=1 if o0 else 2, marker=MARKERS[r["level"]],
            markevery=(5 * i, 40), markersize=5, markerfacecolor="none",
        )  # fmt: skip
    ax_loss.set(
        title="Training loss of each level (10-step mean)",
        xlabel="step",
        ylabel="training cross-entropy (log scale)",
        yscale="log",
    )
    ax_loss.legend(fontsize=8, ncol=2)

    dynamic = [r for r in levels if r["loss_scaling"] != "none"]
    for i, r in enumerate(dynamic):
        color, at = COLORS[r["level"]], r["skipped_at"]
        ax_scale.plot(
            r["loss_scales"], drawstyle="steps-post", color=color, ls="--" if i else "-",
            lw=1.4 if i else 3.0, label=f"{r['run']}: loss scale",
        )  # fmt: skip
        ax_scale.scatter(
            at, [r["loss_scales"][s] for s in at], marker="+x"[i % 2], s=80, lw=1.6,
            color=color, zorder=3, label=f"{r['run']}: skipped step ({len(at)})",
        )  # fmt: skip
    unscaled = [r for r in levels if r["loss_scaling"] == "none"]
    notes = []
    if unscaled:  # non-breaking spaces keep each run's name on one line
        names = ", ".join(r["run"].replace(" ", "\N{NO-BREAK SPACE}") for r in unscaled)
        notes.append(textwrap.fill(f"No loss scale: {names}.", 50))
    if any(r["dtype"] == "bfloat16" for r in unscaled):
        notes.append("bfloat16: no loss scale needed (it has float32's\nexponent range).")
    if any(r["level"] == "O3" for r in unscaled):
        notes.append("O3 keeps half params (as apex O3): nothing to unscale into.")
    if dynamic:
        cfg = dynamic[0]["scale_config"]
        ax_scale.set_title(
            f"Dynamic loss scale of the float16 runs: starts at {pow2(cfg['initial'])}, halves "
            f"and skips the step\non overflow, doubles after {cfg['period']} finite steps "
            f"(capped at {pow2(cfg['max'])})",
            fontsize=10,
        )
        ax_scale.set_yscale("log", base=2)
        lo = min(min(r["loss_scales"]) for r in dynamic)
        hi = max(max(r["loss_scales"]) for r in dynamic)
        ax_scale.set_ylim(lo / 2**7, hi * 2**4)  # room for the legend and the note
        ax_scale.yaxis.set_major_locator(LogLocator(base=2))
        ax_scale.yaxis.set_major_formatter(FuncFormatter(lambda v, _: pow2(v)))
        ax_scale.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.07, 1.0))
    else:
        ax_scale.set_title("Loss scale")
        ax_scale.set_yticks([])
    if notes:
        ax_scale.text(
            0.98, 0.03, "\n".join(notes), transform=ax_scale.transAxes, ha="right", va="bottom",
            fontsize=8, bbox={"boxstyle": "round", "facecolor": "whitesmoke", "edgecolor": "grey"},
        )  # fmt: skip
    ax_scale.set(xlabel="step", ylabel="loss scale (log2 axis)")

    if study:
        ax_why, ax_zero = axes[1]
        styles = {
            "float32": ("black", "-", 3.0, 0.45),
            "weighted none": ("tab:red", "-", 1.6, 1.0),
            "weighted dynamic": ("tab:blue", "--", 1.6, 1.0),
            "none": ("tab:green", "-.", 1.4, 1.0),
        }
        for r in study:
            key = "float32" if r["level"] == "O0" else r["loss_scaling"]
            key = f"weighted {key}" if r["loss_weight"] != 1 and r["level"] != "O0" else key
            color, ls, lw, alpha = styles.get(key, ("tab:gray", ":", 1.4, 1.0))
            label = r["run"]
            if r["loss_scaling"] != "none" and min(r["loss_scales"]) == max(r["loss_scales"]):
                label += f" (at {pow2(r['loss_scales'][0])} throughout)"
            style = {"label": label, "color": color, "ls": ls, "lw": lw, "alpha": alpha}
            ax_why.plot(smooth(r["losses"]), **style)
            ax_zero.plot(100 * smooth(r["zero_grad_shares"]), **style)
        ax_why.set_title(
            f"Why float16 needs a loss scale: loss x{pow2(WEIGHT)}, lr x{pow2(1 / WEIGHT)} (the "
            "same training in\nexact arithmetic), so the gradients are as small as a large "
            "model's",
            fontsize=10,
        )
        ax_why.set(xlabel="step", ylabel="training cross-entropy (log scale)", yscale="log")
        ax_why.legend(fontsize=8, loc="center right")
        ax_zero.set_title(
            "Gradient entries that are exactly zero (10-step mean):\nfloat16 underflow, "
            "above float32's dead ReLUs",
            fontsize=10,
        )
        ax_zero.set(xlabel="step", ylabel="gradient entries == 0 (%)", ylim=(0, 105))
        ax_zero.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.92))
    if title:
        fig.suptitle(title, fontsize=11)
    if study:
        fig.text(
            0.5, 0.005,
            f"Loss x{pow2(WEIGHT)} stands in for a large model, whose activation gradients mostly "
            "sit below float16's smallest normal, 2^-14 (Micikevicius et al. 2018).\nSpeed, "
            "step memory and a verdict per level: the printed tables and digits_results.json.",
            ha="center", va="bottom", fontsize=8.5, color="dimgray",
        )  # fmt: skip
    fig.tight_layout(rect=(0, 0.035 if study else 0, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", choices=[*mpjax.LEVELS, "fp8", "all"], default="all")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "both"], default="both")
    parser.add_argument(
        "--fp8-recipe", choices=list(RECIPES), default="delayed", help="the fp8 level's recipe"
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scale-init", type=float, default=2.0**24, help="initial dynamic loss scale"
    )
    parser.add_argument(
        "--scale-period",
        type=int,
        default=40,
        help="finite steps between growths of the dynamic scale (the library default: 2000)",
    )
    parser.add_argument("--out", default=os.path.join("examples", "out"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-bar", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)
    if jax.default_backend() == "cpu":
        # The demo runs every level on purpose: say once what mpjax's HardwareWarning says
        # per half dtype, and let the table show it.
        warnings.simplefilter("ignore", mpjax.HardwareWarning)
        print(
            "On a CPU half precision saves memory but runs slower than float32 (no fast half "
            "math here); the table shows both. On a GPU or TPU the half levels are the fast ones."
        )

    levels = (*mpjax.LEVELS, "fp8") if args.level == "all" else (args.level,)
    halves = ("float16", "bfloat16") if args.dtype == "both" else (args.dtype,)
    # FP8 runs on a bfloat16 base (the FP8 training convention), whatever --dtype says.
    runs = [
        (lv, h)
        for lv in levels
        for h in (("bfloat16",) if lv == "fp8" else halves if lv != "O0" else halves[:1])
    ]
    dynamic = mpjax.DynamicLossScale(args.scale_init, period=args.scale_period)

    def level_scale(lv, h):
        # The kind of scale the level implies, with this example's initial value and period.
        base = mpjax.fp8.policy("O2", h).base if lv == "fp8" else mpjax.Policy.from_level(lv, h)
        return dynamic if scale_kind(base.loss_scale()) == "dynamic" else None

    data = load_data(args.seed)
    steps = args.epochs * (len(data[0]) // args.batch)
    title = (
        f"jax {jax.__version__} on {jax.default_backend()}; {len(data[0])} train, "
        f"{len(data[1])} test digits; {args.epochs} epochs of batch {args.batch} ({steps} steps)"
    )
    print(title)
    common = (args.epochs, args.batch, args.lr, args.seed, data, not args.no_bar)
    results = [
        train(lv, h, *common, scale=level_scale(lv, h), recipe=args.fp8_recipe) for lv, h in runs
    ]
    if args.level == "all" and "float16" in halves:
        # The loss-scaling runs (module docstring): each logs its zero gradient entries.
        none, weighted = mpjax.NoOpLossScale(), f"loss x{pow2(WEIGHT)}"
        study = [
            ("O0", f"O0 float32, {weighted}", none, WEIGHT),
            ("O2", "O2 float16, no scale", none, 1.0),
            ("O2", f"O2 float16, {weighted}, no scale", none, WEIGHT),
            ("O2", f"O2 float16, {weighted}, dynamic scale", dynamic, WEIGHT),
        ]
        results += [
            train(lv, "float16", *common, scale=sc, loss_weight=w, name=n, count_zeros=True)
            for lv, n, sc, w in study
        ]
    backend = jax.default_backend()
    lines = add_verdicts(results, backend)
    print()
    print(table(results))
    if lines:
        print(f"\nWhat each level bought on this machine ({backend}), against O0 float32:")
        print("\n".join(f"- {line}" for line in lines))
    if any(r["zero_grad_share"] is not None for r in results):
        print(f"\nWhy float16 needs a loss scale (loss x{pow2(WEIGHT)}, lr x{pow2(1 / WEIGHT)}):")
        print(scaling_table(results))
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "digits_results.json")
    with open(json_path, "w") as f:
        json.dump(results, f)
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        path = os.path.join(args.out, "digits_loss.png")
        plot(results, path, title)
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
