"""Train in bfloat16 with no float32 master copy: stochastic rounding and compensated updates.

Two tasks, five ways each, with Adam, over several seeds:

- the digits CNN of ``train_digits.py`` (scikit-learn's bundled 8x8 digits);
- a small character-level Transformer language model on a text that ships with Python (the
  source of the standard library's ``textwrap`` module: nothing is downloaded).

The five ways:

(a) float32: level O0;
(b) O2 bfloat16 with float32 master weights (what apex O2 and torch.amp keep);
(c) bfloat16 params, rounded to nearest (``mpjax.half_updates(adam, "nearest")``);
(d) bfloat16 params, stochastic rounding (``mpjax.half_updates(adam, "stochastic",
    state_dtype="bfloat16")``), Adam's moments in bfloat16 too;
(e) bfloat16 params, compensated (``mpjax.half_updates(adam, "kahan",
    state_dtype="bfloat16")``): a 16-bit buffer keeps the float32 sum's low bits;
(f) bfloat16 params, stochastic rounding, Adam's moments in 8 bits
    (``mpjax.half_updates(mpjax.quantize_moments(adam))``).

Runs (c)-(e) use ``Policy.from_level("O2", "bfloat16", master_weights=False)``, so they
compute as (b) does; they differ only in how the params are stored and updated. (c)-(e) run
Adam in float32 inside the wrapper; only what is kept between steps differs.

The learning rate is small next to the weights: Adam's step is about the learning rate
(1e-4 for the digits, 3e-4 for the language model), and bfloat16's gap between neighbours
at a weight of 0.1 is 2**-11, about 5e-4, so a step below half of it rounds away. That is
the regime of long runs, decayed schedules and fine-tuning, where round-to-nearest loses
most updates and (c) stalls.

Each run reports the final metric (test accuracy and test loss for the digits, held-out
loss in nats per character for the language model) as mean ± standard deviation over the
seeds (each seed draws its own init, data order and rounding), and the bytes per parameter
that live between steps, counted from the params and optimizer-state pytrees. It prints a
table, writes ``half_params.json`` (every number, with loss curves) and ``half_params.png``.

    python examples/half_params.py              # both tasks, 3 seeds (19 minutes on 2 CPU cores)
    python examples/half_params.py --quick      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import CNN, cross_entropy, load_data  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402

RUNS = {
    "float32": "(a) O0, float32 params and Adam state",
    "O2 float32 masters": "(b) O2 bf16 compute, float32 master weights",
    "bf16 nearest": "(c) bf16 params, round-to-nearest",
    "bf16 stochastic": "(d) bf16 params, stochastic rounding, bf16 moments",
    "bf16 kahan": "(e) bf16 params, compensated (16-bit buffer), bf16 moments",
    "bf16 8-bit moments": "(f) bf16 params, stochastic rounding, 8-bit moments",
}


def policy_and_tx(run: str, lr: float):
    """The policy and optimizer of a run; `tx_for(seed)` gives each seed its rounding key."""
    adam = optax.adam(lr)
    if run == "float32":
        return mpjax.Policy.from_level("O0"), lambda seed: adam
    if run == "O2 float32 masters":
        return mpjax.Policy.from_level("O2", "bfloat16"), lambda seed: adam
    policy = mpjax.Policy.from_level("O2", "bfloat16", master_weights=False)
    if run == "bf16 nearest":
        return policy, lambda seed: mpjax.half_updates(adam, "nearest")
    if run == "bf16 8-bit moments":  # every moment of >= 256 elements (the small models)
        return policy, lambda seed: mpjax.half_updates(
            mpjax.quantize_moments(adam, min_size=256, key=seed), "stochastic", key=seed
        )
    mode = "stochastic" if run == "bf16 stochastic" else "kahan"
    return policy, lambda seed: mpjax.half_updates(adam, mode, key=seed, state_dtype="bfloat16")


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def tree_size(tree) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(tree))


def summary(task, run, metric, values, params, opt_state, steps, start, losses, **extra):
    """A run's record: its per-seed metric, bytes per parameter (params + optimizer state of
    one seed, as the vmapped pytrees hold them), timing and mean loss curve."""
    losses = np.asarray(losses)
    first = lambda t: jax.tree_util.tree_map(lambda a: a[0], t)
    n = tree_size(first(params))
    return {
        "task": task,
        "run": run,
        "metric": metric,
        "values": np.asarray(values).tolist(),
        **extra,
        "n_params": n,
        "bytes_per_param": (tree_bytes(first(params)) + tree_bytes(first(opt_state))) / n,
        "steps": steps,
        "seconds": time.perf_counter() - start,
        "loss_curve": losses.mean(axis=0).tolist(),
        "loss_curve_std": losses.std(axis=0).tolist(),
    }


# -- the digits CNN -------------------------------------------------------------------------------


def train_digits(run: str, seeds: int, epochs: int, lr: float, data) -> dict:
    x_train, x_test, y_train, y_test = (jnp.asarray(a) for a in data)
    policy, tx_for = policy_and_tx(run, lr)
    model = mpjax.flax.wrap(CNN(), policy)
    batch = 64
    steps = epochs * (len(x_train) // batch)

    def init(seed):
        variables = model.init(jax.random.key(seed), x_train[:1])
        params = variables["params"]
        return params, variables["batch_stats"], tx_for(seed).init(params)

    tx = tx_for(0)  # the update is the same for every seed; the key lives in the state

    def train(params, stats, opt_state, order):
        def step(carry, idx):
            params, stats, opt_state = carry

            def loss_fn(p):
                logits, new = model.apply(
                    {"params": p, "batch_stats": stats}, x_train[idx], train=True,
                    mutable=["batch_stats"],
                )  # fmt: skip
                return cross_entropy(logits, y_train[idx]), new["batch_stats"]

            (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), stats, opt_state), loss

        (params, stats, opt_state), losses = jax.lax.scan(step, (params, stats, opt_state), order)
        logits = model.apply({"params": params, "batch_stats": stats}, x_test)
        metrics = (cross_entropy(logits, y_test), jnp.mean(jnp.argmax(logits, -1) == y_test))
        return metrics, losses

    seed_ids = jnp.arange(seeds)
    params, stats, opt_state = jax.jit(jax.vmap(init))(seed_ids)
    # Each seed its own data order: `steps` batches of shuffled indices.
    orders = np.stack(
        [
            np.concatenate(
                [np.random.default_rng(s).permutation(len(x_train)) for _ in range(epochs + 1)]
            )[: steps * batch].reshape(steps, batch)
            for s in range(seeds)
        ]
    )
    start = time.perf_counter()
    (test_loss, test_acc), losses = jax.jit(jax.vmap(train))(params, stats, opt_state, orders)
    return summary(
        "digits CNN", run, "test accuracy", test_acc, params, opt_state, steps, start, losses,
        test_loss=np.asarray(test_loss).tolist(),
    )  # fmt: skip


# -- the character-level Transformer ------------------------------------------------------------


def corpus() -> tuple[np.ndarray, int]:
    """The source of ``textwrap`` as bytes (about 20 KB): a text every Python ships with."""
    with open(textwrap.__file__, "rb") as f:
        data = np.frombuffer(f.read(), np.uint8)
    return data.astype(np.int32), 256


class Block(nn.Module):
    d: int
    heads: int

    @nn.compact
    def __call__(self, x):
        n = x.shape[1]
        mask = nn.make_causal_mask(jnp.ones((x.shape[0], n)))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(h)))


class CharLM(nn.Module):
    """A small GPT: byte embeddings, learned positions, pre-norm blocks, tied output."""

    vocab: int = 256
    d: int = 64
    layers: int = 2
    heads: int = 4
    context: int = 64

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.d)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.context, self.d))
        x = embed(tokens) + pos[: tokens.shape[1]]
        for _ in range(self.layers):
            x = Block(self.d, self.heads)(x)
        return embed.attend(nn.LayerNorm()(x))


def train_lm(run: str, seeds: int, steps: int, lr: float, text: np.ndarray) -> dict:
    policy, tx_for = policy_and_tx(run, lr)
    context, batch = 64, 32
    model = mpjax.flax.wrap(CharLM(context=context), policy)
    split = int(0.9 * len(text))
    train_text, test_text = jnp.asarray(text[:split]), jnp.asarray(text[split:])
    # The held-out text in windows: the loss of each next byte given up to `context` before.
    starts = np.arange(0, len(test_text) - context - 1, context)
    test_windows = np.stack([np.asarray(test_text)[s : s + context + 1] for s in starts])

    def lm_loss(params, windows):
        logits = model.apply({"params": params}, windows[:, :-1])
        return cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))

    def init(seed):
        params = model.init(jax.random.key(seed), jnp.zeros((1, context), jnp.int32))["params"]
        return params, tx_for(seed).init(params)

    tx = tx_for(0)

    def train(params, opt_state, offsets):
        def step(carry, offs):
            params, opt_state = carry
            windows = jax.vmap(lambda o: jax.lax.dynamic_slice(train_text, (o,), (context + 1,)))(
                offs
            )
            loss, grads = jax.value_and_grad(lm_loss)(params, windows)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), offsets)
        return lm_loss(params, jnp.asarray(test_windows)), losses

    params, opt_state = jax.jit(jax.vmap(init))(jnp.arange(seeds))
    offsets = np.stack(
        [
            np.random.default_rng(100 + s).integers(0, split - context - 1, (steps, batch))
            for s in range(seeds)
        ]
    ).astype(np.int32)
    start = time.perf_counter()
    test_loss, losses = jax.jit(jax.vmap(train))(params, opt_state, offsets)
    return summary(
        "char Transformer LM", run, "held-out loss (nats/char)", test_loss, params, opt_state,
        steps, start, losses,
    )  # fmt: skip


# -- report ---------------------------------------------------------------------------------------


def cell(values, percent: bool) -> str:
    """Mean ± standard deviation over the seeds."""
    v = np.asarray(values) * (100 if percent else 1)
    return f"{v.mean():.2f} ± {v.std():.2f}" + ("%" if percent else "")


def table(runs) -> str:
    lines = [
        "| task | run | bytes/param | metric (mean ± std over seeds) | vs (b) |",
        "|---|---|---:|---:|---:|",
    ]
    for r in runs:
        percent = r["metric"] == "test accuracy"
        ref = next(x for x in runs if x["task"] == r["task"] and x["run"] == "O2 float32 masters")
        diff = (np.mean(r["values"]) - np.mean(ref["values"])) * (100 if percent else 1)
        metric = f"{r['metric']} {cell(r['values'], percent)}"
        if "test_loss" in r:
            metric += f" (test loss {cell(r['test_loss'], False)})"
        lines.append(
            f"| {r['task']} | {RUNS[r['run']]} | {r['bytes_per_param']:.2f} | {metric} | "
            f"{diff:+.2f}{'pt' if percent else ''} |"
        )
    return "\n".join(lines)


def smooth(values, k: int):
    values = np.asarray(values, float)
    return np.convolve(values, np.ones(k) / k, mode="valid") if len(values) > k else values


def plot(runs, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in runs))
    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 5), squeeze=False)
    styles = {
        "float32": ("black", "-", 2.5, 0.4),
        "O2 float32 masters": ("tab:blue", "-", 1.6, 1.0),
        "bf16 nearest": ("tab:red", "-", 1.6, 1.0),
        "bf16 stochastic": ("tab:green", "--", 1.6, 1.0),
        "bf16 kahan": ("tab:purple", ":", 2.0, 1.0),
        "bf16 8-bit moments": ("tab:orange", "-.", 1.6, 1.0),
    }
    for ax, task in zip(axes[0], tasks):
        for r in (r for r in runs if r["task"] == task):
            color, ls, lw, alpha = styles[r["run"]]
            k = max(1, len(r["loss_curve"]) // 40)
            y = smooth(r["loss_curve"], k)
            label = f"{RUNS[r['run']]} ({r['bytes_per_param']:.0f} B/param)"
            ax.plot(np.arange(len(y)) + k, y, color=color, ls=ls, lw=lw, alpha=alpha, label=label)
        ax.set(
            title=f"{task}: training loss (mean over seeds, {k}-step average)",
            xlabel="step",
            ylabel="training cross-entropy (nats, log scale)",
            yscale="log",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--digits-epochs", type=int, default=None)
    parser.add_argument("--digits-lr", type=float, default=1e-4)
    parser.add_argument("--lm-steps", type=int, default=None)
    parser.add_argument("--lm-lr", type=float, default=3e-4)
    parser.add_argument("--tasks", default="digits,lm")
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated ways to run")
    parser.add_argument("--out", default=".", help="where to write the JSON and the PNG")
    args = parser.parse_args(argv)
    seeds = args.seeds or (2 if args.quick else 3)
    epochs = args.digits_epochs or (2 if args.quick else 10)
    lm_steps = args.lm_steps or (20 if args.quick else 600)
    tasks = args.tasks.split(",")
    chosen = [run for run in RUNS if run in args.runs.split(",")]
    if not chosen:
        parser.error(f"--runs names none of {list(RUNS)}")

    runs = []
    start = time.perf_counter()
    if "digits" in tasks:
        data = load_data()
        for run in chosen:
            runs.append(train_digits(run, seeds, epochs, args.digits_lr, data))
            print(f"digits {run}: {cell(runs[-1]['values'], True)}", file=sys.stderr)
    if "lm" in tasks:
        text, _ = corpus()
        for run in chosen:
            runs.append(train_lm(run, seeds, lm_steps, args.lm_lr, text))
            print(f"lm {run}: {cell(runs[-1]['values'], False)}", file=sys.stderr)
    print(
        f"Adam; {seeds} seeds; digits: {epochs} epochs at lr {args.digits_lr:g}; "
        f"LM: {lm_steps} steps at lr {args.lm_lr:g}; {time.perf_counter() - start:.0f} s\n"
    )
    print(table(runs))
    os.makedirs(args.out, exist_ok=True)
    results = {
        "config": {
            "seeds": seeds,
            "digits_epochs": epochs,
            "digits_lr": args.digits_lr,
            "lm_steps": lm_steps,
            "lm_lr": args.lm_lr,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
        },
        "runs": runs,
    }
    with open(os.path.join(args.out, "half_params.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(runs, os.path.join(args.out, "half_params.png"))
    return results


if __name__ == "__main__":
    main()
