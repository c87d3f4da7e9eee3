"""Hugging Face's Flax GPT-2 and BERT (the test corpus) trained with bfloat16 params, 3 seeds.

    python benchmarks/half_params_corpus.py [--steps 60] [--seeds 3]

Each seed draws the model's init and its batch (``tests/test_corpus_models.py``); each model
is wrapped at O2 bfloat16 and trained with Adam (lr 1e-4) for the same steps, four ways:
float32 masters, bfloat16 params with round to nearest, with stochastic rounding and
bfloat16 moments, and with stochastic rounding and 8-bit moments
(``mpjax.half_updates(mpjax.quantize_moments(adam))``). The table gives the final training
loss (mean ± std over the seeds), the bytes per parameter between steps (params + optimizer
state, counted from the pytrees), and each way's mean distance from float32 masters in units
of the masters' own seed-to-seed standard deviation.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import harness  # noqa: E402

import mpjax  # noqa: E402

RUNS = ("float32 masters", "bf16 nearest", "bf16 stochastic + bf16 moments",
        "bf16 stochastic + 8-bit moments")  # fmt: skip


def policy_and_tx(run: str, lr: float, seed: int):
    if run == "float32 masters":
        return mpjax.Policy.from_level("O2", "bfloat16"), optax.adam(lr)
    policy = mpjax.Policy.from_level("O2", "bfloat16", master_weights=False)
    adam = optax.adam(lr)
    if run == "bf16 nearest":
        return policy, mpjax.half_updates(adam, "nearest", key=seed)
    if run == "bf16 stochastic + bf16 moments":
        return policy, mpjax.half_updates(adam, key=seed, state_dtype="bfloat16")
    # The test models are small: quantize every moment of at least 256 elements.
    return policy, mpjax.half_updates(mpjax.quantize_moments(adam, min_size=256, key=seed),
                                      key=seed)  # fmt: skip


def nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def train(case, run: str, steps: int, lr: float, seed: int) -> tuple[float, float]:
    policy, tx = policy_and_tx(run, lr, seed)
    params, loss = case.init(policy), case.loss(policy)
    opt_state = tx.init(params)
    size = sum(np.size(x) for x in jax.tree_util.tree_leaves(params))
    per_param = (nbytes(params) + nbytes(opt_state)) / size

    @jax.jit
    def step(params, opt_state):
        (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params, case.batch, case.key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    for _ in range(steps):
        params, opt_state, value = step(params, opt_state)
    return float(value), per_param


def main(argv=None) -> dict:
    from test_corpus_models import GPT2_SEED, bert_case, gpt2_case

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--runs", default=",".join(RUNS), help="ways to run (and masters)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    makers = {"gpt2": lambda s: gpt2_case(GPT2_SEED + s), "bert": bert_case}
    runs = [r for r in RUNS if r in args.runs.split(",") or r == "float32 masters"]
    rows, result = [], {"config": vars(args), "final": {}}
    for model in args.models.split(","):
        finals: dict[str, list[float]] = {}
        sizes: dict[str, float] = {}
        for seed in range(args.seeds):
            case = makers[model](seed)
            for run in runs:
                value, per_param = train(case, run, args.steps, args.lr, seed)
                finals.setdefault(run, []).append(value)
                sizes[run] = per_param
                print(f"{model} seed {seed} {run}: {value:.4f}", flush=True)
        ref = np.asarray(finals["float32 masters"])
        noise = float(np.std(ref)) or float("nan")
        for run in runs:
            v = np.asarray(finals[run])
            gap = float(np.mean(v - ref))
            rows.append([model, run, f"{v.mean():.4f} ± {v.std():.4f}", f"{sizes[run]:.2f}",
                         f"{gap:+.4f} ({gap / noise:+.1f} sd)"])  # fmt: skip
        result["final"][model] = finals
    md = (
        f"### GPT-2 and BERT (test corpus), {args.steps} Adam steps at lr {args.lr:g}, "
        f"{args.seeds} seeds\n\n"
        + harness.table(
            ["model", "way", "final loss", "bytes/param", "mean gap to masters (seed sd)"],
            rows,
        )
    )
    print(md)
    result["markdown"] = md
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
