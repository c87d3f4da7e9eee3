"""FP8's accuracy on the benchmark's Transformer: its loss over N Adam steps against mpjax O2
bfloat16's, over several seeds, so the gap is read against seed noise.

    python benchmarks/fp8_accuracy.py                      # small Transformer, 300 steps, 3 seeds
    python benchmarks/fp8_accuracy.py --size tiny --steps 50 --seeds 2

The data is a stream that cannot be memorized: every step draws a fresh batch of sequences
from one fixed first-order Markov chain over the vocabulary (each token's successors a
softmax of Gaussian logits; its entropy rate, printed, is the best loss any model reaches).
Each seed initializes the float32 Transformer LM of ``models.py`` with its own key and draws
its own stream; each variant trains on the same params and stream, with the same Adam as
``models.py``: O2 bfloat16 (``mpjax.flax.wrap``), FP8 with delayed scaling (the default,
``mpjax.fp8.policy("O2")``) and FP8 with current scaling per tensor and per row. On a CPU
the FP8 dots are emulated (the same float8 roundings, no FP8 gemm): the numbers are the
GPU's.

A run's loss is its mean over the last fifth of the steps (one step's loss is one batch's
draw). FP8 is within seed noise when its mean over seeds is within two standard deviations of
the seeds' O2 bfloat16 losses; the table also gives each variant's gap above the entropy rate.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import models  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402
import mpjax.fp8  # noqa: E402

VARIANTS = (
    "O2 bfloat16",
    "FP8 delayed (default)",
    "FP8 current",
    "FP8 current rows",
    "MXFP8",
    "NVFP4",
    "NVFP4, head and last block bf16",
)
# How peaked the chain's transitions are: logits ~ N(0, SHARPNESS^2).
SHARPNESS = 3.0


def chain(vocab: int) -> jax.Array:
    """The fixed Markov chain's log transition matrix, [vocab, vocab] (rows sum to one)."""
    logits = SHARPNESS * jax.random.normal(jax.random.key(1234), (vocab, vocab))
    return jax.nn.log_softmax(logits, axis=-1)


def entropy_rate(log_p: jax.Array) -> float:
    """The chain's entropy per token (nats) under its stationary distribution: the loss floor."""
    p = jnp.exp(log_p)
    pi = jnp.full((p.shape[0],), 1.0 / p.shape[0])
    for _ in range(200):  # power iteration: the chain mixes in a few steps
        pi = pi @ p
    return float(-(pi[:, None] * p * log_p).sum())


@functools.partial(jax.jit, static_argnames=("batch", "seq"))
def draw(log_p: jax.Array, key: jax.Array, batch: int, seq: int) -> tuple[jax.Array, jax.Array]:
    """A batch of sequences from the chain: (tokens, next tokens), [batch, seq] each."""
    first, rest = jax.random.split(key)
    start = jax.random.randint(first, (batch,), 0, log_p.shape[0])

    def walk(tok: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        nxt = jax.random.categorical(k, log_p[tok])
        return nxt, nxt

    _, toks = jax.lax.scan(walk, start, jax.random.split(rest, seq))
    toks = jnp.concatenate([start[None], toks], axis=0).T  # [batch, seq + 1]
    return toks[:, :-1], toks[:, 1:]


def train(variant: str, seed: int, size: str, steps: int) -> list[float]:
    """The loss at each step of one run (seed: the init and the stream)."""
    module, x0, _, _ = models.build("transformer", size)
    batch, seq = x0.shape
    log_p = chain(module.vocab)
    tx = optax.adam(1e-3)
    if variant == "O2 bfloat16":
        model = mpjax.flax.wrap(module, mpjax.Policy.from_level("O2", "bfloat16"))
        params = model.init(jax.random.key(seed), x0)["params"]
        grad = jax.value_and_grad(
            functools.partial(models.loss_and_stats, model, "default"), has_aux=True
        )
        grads_of = lambda params, extra, x, y: (*grad(params, {}, x, y), extra)
        extra = None
    else:
        recipe = {
            "FP8 current": mpjax.fp8.CurrentScaling(),
            "FP8 current rows": mpjax.fp8.CurrentScaling(granularity="row"),
            "MXFP8": mpjax.fp8.MXFP8BlockScaling(),
            "NVFP4": mpjax.fp8.NVFP4BlockScaling(),
            # NVIDIA's choice for its published runs: the last blocks and the head in bf16
            "NVFP4, head and last block bf16": mpjax.fp8.NVFP4BlockScaling(
                high_precision=("Dense_0", f"Block_{module.depth - 1}/*")
            ),
        }.get(variant)
        policy = mpjax.fp8.policy("O2", recipe=recipe)
        params = module.init(jax.random.key(seed), x0)["params"]
        fn = functools.partial(models.loss_and_stats, module, "default")
        grad = mpjax.fp8.scaled_value_and_grad(fn, policy, has_aux=True)
        grads_of = lambda params, fp8_state, x, y: grad(fp8_state, params, {}, x, y)
        extra = mpjax.fp8.init(fn, policy, params, {}, x0, x0)  # the FP8 state

    @jax.jit
    def step(params, opt_state, extra, x, y):
        (loss, _), grads, extra = grads_of(params, extra, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, extra, loss

    state = (params, tx.init(params), extra)
    losses = []
    for k in jax.random.split(jax.random.key(seed), steps):
        *state, loss = step(*state, *draw(log_p, k, batch, seq))
        losses.append(float(loss))
    return losses


def tail_mean(losses: list[float]) -> float:
    """A run's loss: its mean over the last fifth of the steps (at least one)."""
    tail = losses[-max(1, len(losses) // 5) :]
    return sum(tail) / len(tail)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--variant", choices=VARIANTS, action="append", help="these only (O2 bfloat16 always)"
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    variants = VARIANTS
    if args.variant:
        variants = tuple(v for v in VARIANTS if v == "O2 bfloat16" or v in args.variant)
    floor = entropy_rate(chain(models.build("transformer", args.size)[0].vocab))
    final: dict[str, list[float]] = {v: [] for v in variants}
    curves: dict[str, list[list[float]]] = {v: [] for v in variants}
    for seed in range(args.seeds):
        for variant in variants:
            losses = train(variant, seed, args.size, args.steps)
            if not all(math.isfinite(v) for v in losses):
                raise RuntimeError(f"{variant}, seed {seed}: a loss is not finite")
            final[variant].append(tail_mean(losses))
            curves[variant].append(losses)
            print(
                f"  seed {seed} {variant}: {losses[0]:.4f} -> {tail_mean(losses):.4f}",
                file=sys.stderr,
            )
    base = final["O2 bfloat16"]
    mean0, sd0 = statistics.mean(base), statistics.stdev(base) if len(base) > 1 else 0.0
    rows = []
    for variant in variants:
        mean = statistics.mean(final[variant])
        sd = statistics.stdev(final[variant]) if len(final[variant]) > 1 else 0.0
        within = abs(mean - mean0) <= 2 * sd0
        rows.append([variant, f"{mean:.4f} ± {sd:.4f}", f"{mean - floor:.4f}",
                     f"{mean - mean0:+.4f}", "yes" if within else "no"])  # fmt: skip
    info = harness.machine()
    md = (
        f"### FP8 accuracy: Transformer ({args.size}), {args.steps} Adam steps on a fresh "
        f"Markov-chain stream (entropy rate {floor:.4f} nats), {args.seeds} seeds "
        f"({info['device']}, jax {info['jax']})\n\n"
        + harness.table(
            [
                "variant",
                "loss, last fifth of the steps (mean ± sd over seeds)",
                "above the entropy rate",
                "vs O2 bfloat16",
                "within 2 sd of O2 bfloat16's seeds",
            ],
            rows,
        )  # fmt: skip
    )
    print(md)
    result = {
        "machine": info,
        "config": vars(args),
        "entropy_rate": floor,
        "final": final,
        "curves": curves,
        "markdown": md,
    }
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
