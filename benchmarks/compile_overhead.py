"""Tracing cost of a wrapped train step against the hand-written half step.

A train step (loss, grad, AdamW update, jitted) of two language models, an 8-layer GPT with
its layers unrolled and the same GPT with its layers in ``nn.scan``, is built three ways and
timed from scratch, interleaved round by round (a fresh step function each time, so jit's
cache is never hit):

- dtype=: the hand-written half step, Flax modules with ``dtype=`` set to the half dtype and
  float32 params (no loss scaling in bfloat16; Flax's ``DynamicScale`` in float16);
- mpjax, first trace: ``mpjax.flax.wrap(model, policy)`` made afresh each round, with
  ``mpjax.loss_scale`` around AdamW: what the first trace of a program (a new shape, a new
  process) costs;
- mpjax, retrace: one wrapped model for every round, so its autocast trace is reused: what a
  retrace with shapes seen before (a new jit of the step, an eager call) costs.

Each is split into trace+lower (``jit(step).trace(...).lower()``: Python, autocast and
JAX) and compile (XLA). Reports the medians, the median paired ratio to dtype= (target for
trace+lower: <= 1.3), and the jaxpr equation counts of both steps (every equation, those
inside scans, remats and calls included).

    python benchmarks/compile_overhead.py --level O2 --dtype bfloat16 --rounds 7
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import dynamic_scale

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import models  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402

VOCAB, WIDTH, DEPTH, HEADS = 1024, 256, 8, 4
TOKENS = (4, 64)
TARGET = 1.3
VARIANTS = ("dtype=", "first trace", "retrace")


class _ScanBlock(nn.Module):
    width: int
    heads: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x, mask):
        return models.Block(self.width, self.heads, self.dtype)(x, mask), None


class ScannedLM(models._Transformer):
    """models.TransformerLM with its blocks in one ``nn.scan`` (params stacked by layer)."""

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        del train
        x = nn.Embed(self.vocab, self.width, dtype=self.dtype)(tokens)
        x = x + self.positions(tokens.shape[1])
        stack = nn.scan(
            _ScanBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=self.depth,
        )
        x, _ = stack(self.width, self.heads, self.dtype)(x, nn.make_causal_mask(tokens))
        return nn.Dense(self.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


MODELS = {"GPT, 8 layers unrolled": models.TransformerLM, "GPT, 8 layers in nn.scan": ScannedLM}


def _loss(logits: Any, tokens: Any) -> Any:
    labels = jnp.roll(tokens, -1, axis=1)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def build(cls: type, variant: str, policy: mpjax.Policy, wrapped: Any = None) -> tuple:
    """(step, args) for one variant; `wrapped` is reused for the retrace variant."""
    tokens = jax.random.randint(jax.random.key(1), TOKENS, 0, VOCAB)
    f32 = cls(VOCAB, WIDTH, DEPTH, HEADS)
    params = f32.init(jax.random.key(0), tokens)["params"]
    if variant == "dtype=":
        model = f32.clone(dtype=policy.compute_dtype)
        tx = optax.adamw(1e-3)
        scaler = dynamic_scale.DynamicScale() if policy.compute_dtype == jnp.float16 else None

        def step(params, opt_state, scaler, tokens):
            def loss_fn(p):
                return _loss(model.apply({"params": p}, tokens), tokens).mean()

            if scaler is None:
                grads = jax.grad(loss_fn)(params)
            else:
                scaler, _, _, grads = scaler.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, scaler

        return step, (params, tx.init(params), scaler, tokens)
    model = wrapped if wrapped is not None else mpjax.flax.wrap(f32, policy)
    params = model.init(jax.random.key(0), tokens)["params"]
    tx = mpjax.loss_scale(optax.adamw(1e-3), scale=policy.loss_scale())

    def step(params, opt_state, tokens):  # type: ignore[misc]
        scale = mpjax.get_loss_scale(opt_state)

        def loss_fn(p):
            return scale.scale(_loss(model.apply({"params": p}, tokens), tokens).mean())

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, (params, tx.init(params), tokens)


def time_step(step: Any, args: tuple) -> tuple[float, float]:
    """(trace+lower, compile) seconds of a fresh jit of `step`."""
    gc.collect()
    start = time.perf_counter()
    lowered = jax.jit(step).trace(*args).lower()
    traced = time.perf_counter()
    lowered.compile()
    return traced - start, time.perf_counter() - traced


def equations(jaxpr: Any) -> int:
    """Every equation of `jaxpr`, those of the jaxprs in its equations' params included."""

    def subs(value: Any) -> list[Any]:
        if hasattr(value, "eqns"):
            return [value]
        if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
            return [value.jaxpr]
        if isinstance(value, (tuple, list)):
            return [j for v in value for j in subs(v)]
        return []

    return sum(
        1 + sum(equations(j) for v in e.params.values() for j in subs(v)) for e in jaxpr.eqns
    )


def measure(cls: type, policy: mpjax.Policy, rounds: int) -> dict[str, Any]:
    f32 = cls(VOCAB, WIDTH, DEPTH, HEADS)
    reused = mpjax.flax.wrap(f32, policy)
    for variant in VARIANTS:  # warm up JAX's own caches, and the reused wrapper's trace
        time_step(*build(cls, variant, policy, reused if variant == "retrace" else None))
    trace: dict[str, list[float]] = {v: [] for v in VARIANTS}
    compile_: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            step, args = build(cls, variant, policy, reused if variant == "retrace" else None)
            t, c = time_step(step, args)
            trace[variant].append(t)
            compile_[variant].append(c)
    counts = {}
    for variant in ("dtype=", "first trace"):
        step, args = build(cls, variant, policy)
        counts[variant] = equations(jax.make_jaxpr(step)(*args).jaxpr)
    return {
        "trace_lower_s": {v: statistics.median(t) for v, t in trace.items()},
        "compile_s": {v: statistics.median(t) for v, t in compile_.items()},
        "trace_lower_ratio": {v: harness.paired_ratio(trace, v, "dtype=") for v in VARIANTS[1:]},
        "compile_ratio": {v: harness.paired_ratio(compile_, v, "dtype=") for v in VARIANTS[1:]},
        "equations": {"dtype=": counts["dtype="], "mpjax": counts["first trace"]},
    }


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for name, r in result["models"].items():
        tl, ratio = r["trace_lower_s"], r["trace_lower_ratio"]
        rows.append(
            [
                name,
                f"{tl['dtype=']:.2f}",
                f"{tl['first trace']:.2f} ({ratio['first trace']:.2f}x)",
                f"{tl['retrace']:.2f} ({ratio['retrace']:.2f}x)",
                "met" if ratio["first trace"] <= TARGET else "NOT met",
                f"{r['compile_ratio']['first trace']:.2f}x",
                f"{r['equations']['dtype=']} / {r['equations']['mpjax']}",
            ]
        )
    return harness.table(
        [
            "model",
            "dtype= trace+lower (s)",
            "mpjax first trace (s)",
            "mpjax retrace (s)",
            f"first trace <= {TARGET}x",
            "XLA compile, first trace / dtype=",
            "equations dtype= / mpjax",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", default="O2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", choices=list(MODELS), action="append")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    policy = mpjax.Policy.from_level(args.level, args.dtype)
    result: dict[str, Any] = {
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "policy": f"{args.level} {args.dtype}",
        "models": {},
    }
    for name in args.model or list(MODELS):
        result["models"][name] = measure(MODELS[name], policy, args.rounds)
    result["markdown"] = markdown(result)
    print(f"jax {jax.__version__} on {jax.default_backend()}; {args.level} {args.dtype}")
    print(result["markdown"])
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
