"""Agreement with float32 of every program in the test corpus, per level and half dtype.

The guard a change to autocast's rules runs before and after: each program of
``test_autocast_programs.py`` (literals, epsilons, position tables, sums of squares, decisions,
loops, coordinates, the library zoo, masked attention in jax.nn, linen and NNX, custom rules),
the solver corpus (diffrax, optimistix, lineax) and the model corpus (GPT-2, BERT, an
Equinox-style transformer) runs under ``mpjax.autocast`` at O1-O3 in float16 and bfloat16 beside
its float32 program; its value's and gradient's relative errors are recorded. A cell is *worse*
when its error grew past 1.5x the baseline's plus 1/20 of the half's epsilon (noise between
JAX releases stays under that).

    python tests/agreement.py            # measure; list the cells worse (or better) than baseline
    python tests/agreement.py --write    # measure and rewrite the baseline, after a change
                                         # whose every worse cell is explained
    python tests/agreement.py --family loops --family coordinates   # a part of the corpus
    python tests/agreement.py --reduce-dtype float32   # policies that reduce in float32

``tests/test_agreement.py`` fails on any cell worse than ``tests/agreement_baseline.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import mpjax  # noqa: E402

BASELINE = HERE / "agreement_baseline.json"
LEVELS = ("O1", "O2", "O3")
DTYPES = ("float16", "bfloat16")
CELLS = [f"{lv}-{dt}" for lv in LEVELS for dt in DTYPES]
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# A cell is worse when new > GROWTH * old + NOISE * eps(half).
GROWTH, NOISE = 1.5, 0.05


class Program:
    """One corpus program: `fn(*args)` returns floats; `grad` says how its gradient with respect
    to the first argument is taken ("rev", "fwd" through while loops, None for none)."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], grad: str | None = "rev"):
        self.fn, self.args, self.grad = fn, args, grad


def _f32(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def _floats(tree: Any) -> np.ndarray:
    leaves = [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)]
    return np.concatenate(leaves) if leaves else np.zeros(0)


def rel_err(a: Any, b: Any) -> float:
    a, b = _floats(a), _floats(b)
    if a.size == 0:
        return 0.0
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@functools.cache
def _programs_autocast() -> dict[str, dict[str, Program]]:
    """The program classes of test_autocast_programs.py, on the inputs its tests use."""
    import test_autocast_programs as t

    r = np.random.default_rng
    x48 = _f32(r(0).normal(size=(4, 8)))
    eps_x = r(1).normal(size=(4, 16)) * 3
    eps_x[0], eps_x[1, :8] = 0.0, -30.0
    x_sq = _f32(r(5).normal(size=(8, 256)) * 600.0)
    u = _f32(r(7).uniform(size=(4096,)))
    x_zoo = _f32(r(10).normal(size=(4, 16)))
    y_loop = _f32(r(14).uniform(0.5, 1.5, size=(64,)))
    x_att, pad = t.padded_batch()
    mask = pad[:, None, :, None] & pad[:, None, None, :]

    def dpa(x):
        out = jax.nn.dot_product_attention(x[:, :, None, :], x[:, :, None, :], x[:, :, None, :],
                                           mask=mask)  # fmt: skip
        return out[..., 0, :] * pad[..., None]

    families: dict[str, dict[str, Program]] = {
        "literals": {k: Program(f, (x48,)) for k, f in t.LITERAL_PROGRAMS.items()},
        "epsilons": {k: Program(f, (_f32(eps_x),)) for k, f in t.EPSILON_PROGRAMS.items()},
        "positions": {
            "sinusoidal": Program(t.sinusoidal, (_f32(r(2).normal(size=(512, 64)) * 0.1),)),
            "rope": Program(t.rope, (_f32(r(2).normal(size=(512, 64)) * 0.1),)),
        },
        "squares": {k: Program(f, (x_sq,)) for k, f in t.SQUARE_PROGRAMS.items()},
        "decisions": {
            **{k: Program(f, (u,), grad=None) for k, f in t.DECISION_PROGRAMS.items()},
            "time_loop": Program(t.time_loop, (jnp.ones((4, 4)),), grad=None),
            "newton_sqrt": Program(t.newton_sqrt, (_f32(r(6).uniform(1, 100, (32,))),), None),
            "bilinear": Program(
                t.bilinear, (_f32(r(8).normal(size=(512, 512))), _f32(r(9).uniform(size=(1000, 2))))
            ),
        },
        "coordinates": {
            k: Program(f, _f32(make(r(12)))) for k, (f, make) in t.COORDINATE_PROGRAMS.items()
        },
        "loops": {k: Program(f, (y_loop,), grad="fwd") for k, f in t.LOOP_PROGRAMS.items()},
        "zoo": {k: Program(f, (x_zoo,)) for k, f in t.ZOO.items()},
        "attention": {
            "jax_nn_dot_product_attention": Program(dpa, (x_att,)),
        },
        "custom_rules": {
            "custom_vjp_matmul": Program(
                lambda w, x: t.custom_matmul(x, w) ** 2,
                (_f32(r(3).normal(size=(16, 16)) * 0.3), _f32(r(4).normal(size=(8, 16)))),
            ),
            "custom_jvp_tanh_matmul": Program(
                lambda w, x: t.custom_tanh_matmul(x, w) ** 2,
                (_f32(r(3).normal(size=(16, 16)) * 0.3), _f32(r(4).normal(size=(8, 16)))),
            ),
        },
    }
    try:
        import flax.linen as nn
        from flax import nnx
    except ImportError:
        return families
    linen = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
    lmask = nn.make_attention_mask(pad, pad)
    lparams = linen.init(jax.random.key(0), x_att, mask=lmask)
    families["attention"]["flax_linen_mha"] = Program(
        lambda p, x: linen.apply(p, x, mask=lmask) * pad[..., None], (lparams, x_att)
    )
    nmodel = nnx.MultiHeadAttention(
        num_heads=2, in_features=16, qkv_features=16, decode=False, rngs=nnx.Rngs(0)
    )
    graphdef, state = nnx.split(nmodel)
    nmask = nnx.make_attention_mask(pad, pad)
    families["attention"]["flax_nnx_mha"] = Program(
        lambda s, x: nnx.merge(graphdef, s)(x, mask=nmask) * pad[..., None], (state, x_att)
    )
    return families


# The policies' reduce_dtype (--reduce-dtype): None, the default, reduces in the half dtype.
REDUCE_DTYPE: str | None = None


def policy_for(level: str, dtype: str) -> mpjax.Policy:
    return mpjax.Policy.from_level(level, dtype, reduce_dtype=REDUCE_DTYPE)


def _measure_program(prog: Program, level: str, dtype: str) -> dict[str, float]:
    """The value's and the gradient's relative errors under the policy against float32."""
    policy = policy_for(level, dtype).with_output_dtype("float32")
    mp = mpjax.autocast(prog.fn, policy)
    out = {"value": rel_err(jax.jit(mp)(*prog.args), jax.jit(prog.fn)(*prog.args))}
    if prog.grad is None:
        return out
    first, rest = prog.args[0], prog.args[1:]
    shape = jax.eval_shape(prog.fn, *prog.args)
    draw = np.random.default_rng(99)
    if prog.grad == "rev":
        c = jax.tree.map(lambda s: jnp.asarray(draw.normal(size=s.shape), s.dtype), shape)

        def grad_of(f):
            loss = lambda a: sum(
                jnp.sum(o * w) for o, w in zip(jax.tree.leaves(f(a, *rest)), jax.tree.leaves(c))
            )
            return jax.jit(jax.grad(loss))(first)
    else:
        t = jax.tree.map(lambda a: jnp.asarray(draw.normal(size=a.shape), a.dtype), first)

        def grad_of(f):
            return jax.jit(lambda a: jax.jvp(lambda b: f(b, *rest), (a,), (t,))[1])(first)

    out["grad"] = rel_err(grad_of(mp), grad_of(prog.fn))
    return out


def _solver_cell(name: str, level: str, dtype: str) -> dict[str, float]:
    """A program of the solver corpus (test_corpus_solvers.py): its loss and gradients."""
    import equinox as eqx
    import test_corpus_solvers as s

    if name.startswith("optimistix") and jax.__version_info__ < (0, 6, 2):
        return {}  # JAX 0.6.0 cannot differentiate its jaxpr (test_corpus_solvers)
    loss, model, args = s.programs()[name]
    policy = policy_for(level, dtype)
    ref = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, *args)
    mp = eqx.filter_jit(eqx.filter_value_and_grad(mpjax.autocast(loss, policy)))(model, *args)
    return {"value": rel_err(mp[0], ref[0]), "grad": rel_err(mp[1], ref[1])}


def _model_cell(model: str, level: str, dtype: str) -> dict[str, float]:
    """A model of the model corpus (test_corpus_models.py): loss, logits, gradient direction."""
    import test_corpus_models as m

    got = m.measured(model, level, dtype)
    if not all(got["finite"].values()):
        return {"value": float("inf")}
    return {"value": got["logits"], "loss": got["loss"], "grad": got["1 - cos(grads)"]}


FAMILIES = (
    "literals", "epsilons", "positions", "squares", "decisions", "coordinates", "loops", "zoo",
    "attention", "custom_rules", "solvers", "models",
)  # fmt: skip


def cells(family: str) -> dict[str, Callable[[str, str], dict[str, float]]]:
    """`family`'s programs, each as a function of (level, dtype) to its errors."""
    try:
        if family == "solvers":
            import equinox  # noqa: F401
            import test_corpus_solvers as s

            return {name: functools.partial(_solver_cell, name) for name in s.NAMES}
        if family == "models":
            import test_corpus_models as m

            return {name: functools.partial(_model_cell, name) for name in m.MODELS}
    except ImportError:
        return {}
    programs = _programs_autocast()[family]
    return {name: functools.partial(_measure_program, prog) for name, prog in programs.items()}


def measure(families: tuple[str, ...] = FAMILIES) -> dict[str, dict[str, dict[str, float]]]:
    """{"family/program": {"O2-bfloat16": {"value": err, "grad": err}, ...}} for `families`."""
    result: dict[str, dict[str, dict[str, float]]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in families:
            for name, cell in cells(family).items():
                result[f"{family}/{name}"] = {c: cell(*c.split("-")) for c in CELLS}
    return result


def changes(
    new: dict[str, dict[str, dict[str, float]]],
    old: dict[str, dict[str, dict[str, float]]],
    sign: int = 1,
) -> list[str]:
    """The cells whose error grew (sign=1; shrank: -1) past GROWTH x the other's plus NOISE eps,
    each as 'program cell metric: old -> new'."""
    found = []
    for program, by_cell in new.items():
        for cell, errs in by_cell.items():
            base = old.get(program, {}).get(cell, {})
            eps = EPS[cell.split("-")[1]]
            for metric, err in errs.items():
                if metric not in base:
                    continue
                grown, was = (err, base[metric]) if sign > 0 else (base[metric], err)
                if grown > GROWTH * was + NOISE * eps:
                    found.append(f"{program} {cell} {metric}: {base[metric]:.3g} -> {err:.3g}")
    return found


def worse(
    new: dict[str, dict[str, dict[str, float]]], old: dict[str, dict[str, dict[str, float]]]
) -> list[str]:
    """The cells of `new` whose error grew past GROWTH x `old`'s plus NOISE eps."""
    return changes(new, old, 1)


def load_baseline() -> dict[str, dict[str, dict[str, float]]]:
    return json.loads(BASELINE.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--write", action="store_true", help="rewrite the baseline")
    parser.add_argument("--out", type=pathlib.Path, help="also write the measurement here")
    parser.add_argument("--against", type=pathlib.Path, default=BASELINE)
    parser.add_argument(
        "--reduce-dtype", help="the policies' reduce_dtype (the model corpus keeps its own)"
    )
    args = parser.parse_args()
    global REDUCE_DTYPE
    REDUCE_DTYPE = args.reduce_dtype
    new = measure(tuple(args.family or FAMILIES))
    if args.out:
        args.out.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
    old = json.loads(args.against.read_text()) if args.against.exists() else {}
    got_worse, got_better = worse(new, old), changes(new, old, -1)
    for line in got_worse:
        print("WORSE ", line)
    for line in got_better:
        print("better", line)
    missing = sorted(set(new) - set(old))
    for program in missing:
        print("new   ", program)
    print(f"{len(new)} programs x {len(CELLS)} cells: {len(got_worse)} worse, "
          f"{len(got_better)} better, {len(missing)} not in {args.against.name}")  # fmt: skip
    if args.write:
        merged = {**(load_baseline() if BASELINE.exists() else {}), **new}
        BASELINE.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        print(f"wrote {BASELINE.name}")
    return 1 if got_worse and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
