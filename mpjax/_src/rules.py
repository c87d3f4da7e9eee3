"""The dtype rules of autocast: which dtype each equation runs in, and why.

This module is the policy, in one place; ``autocast.py`` is the machinery that walks jaxprs and
applies it. Two decisions are made here:

* what each value is used for (:func:`use_flags`, per primitive; the interpreter combines
  them backward over a jaxpr): a value that feeds a decision (a comparison, an integer
  convert, a sort, a loop condition) keeps its traced dtype, and the elementwise producers
  that feed only f32-list ops compute in float32;
* the dtype an equation runs in (:func:`target_dtype`), from the policy or region, the
  primitive, and what is known about each operand: a trace-time constant and its value, a
  value held in float32 (a statistic, or a float16 activation leaving a float32 region), an
  index, a loop-carried sum, and the uses above. The README's rule table lists the outcomes.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from mpjax._src import jax_compat as jc
from mpjax._src import ops
from mpjax._src.policy import Policy

# Ops that take operands of unrelated dtypes and pass them through.
_PASS_OPS = frozenset(
    {"device_put", "optimization_barrier", "sharding_constraint", "stop_gradient", "pvary",
     "reshard", "mesh_cast", "name"}
)  # fmt: skip
# Ops that only move data: they keep their input's dtype and the first computing consumer
# casts. Besides saving converts, this keeps backward reductions in float32: the transpose of
# broadcasting a float32 bias is a float32 sum of the half cotangent, not a half sum.
SHAPE_OPS = frozenset(
    {"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "rev", "slice",
     "dynamic_slice", "gather", "copy", "copy_p", "tile", "unstack"}
)  # fmt: skip
# Elementwise ops that broadcast size-1 dimensions implicitly.
_ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "select_n", "clamp",
     "nextafter"}
)  # fmt: skip
# Ops whose meaning depends on the bit width: always run in their traced dtype.
_TRACED_DTYPE_OPS = frozenset({"bitcast_convert_type", "reduce_precision", "nextafter"})
# Ops whose float operands only decide something (a bool, an index, an order): they and the
# values feeding them keep their traced dtype, so rounding cannot flip a decision.
_DECISION_OPS = frozenset(
    {"lt", "le", "gt", "ge", "eq", "ne", "is_finite", "argmax", "argmin", "sort", "top_k"}
)
# Held values (see target_dtype): statistics (f32-list results and what is computed only from
# them), and float16 activations leaving a float32 region, held for float32's range.
_GUARD, _STAT = 1, 2
# Ops that commute with a cast down (a monotone rounding): relu(cast(x)) == cast(relu(x)).
_CAST_COMMUTES = frozenset({"max", "min", "abs", "neg", "select_n", "clamp", "sign"})
# Ops for which a constant operand is a fill or a bound: one beyond the half's range saturates.
_FILL_OPS = frozenset({"select_n", "max", "min", "clamp", "pad"})
# Ops that combine a value that feeds a decision with the decision's result: p - floor(p)
# cancels to the fractional part, which the half rounding of p would lose (an interpolation
# weight rounded to a multiple of 1/8 for p up to 63 in bfloat16).
_CANCELS = frozenset({"add", "sub", "add_any"})
# Ops that pass a loop-carried value on, updated: y - 9e-4 * y, acc.at[i].add(v), a masked
# step jnp.where(done, y, y_new). Run in the carry's traced dtype, the update is not lost
# below half an ulp of the carry (an explicit Euler step in bfloat16 never moves y).
CARRY_OPS = frozenset(
    {"add", "sub", "add_any", "select_n", "dynamic_update_slice", "scatter", "scatter-add",
     "scatter-sub"}
)  # fmt: skip
# Scatters carry their combiner as a jaxpr param; they follow the policy like other ops.
_SCATTERS = frozenset(
    {"scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"}
)


def _narrow(dtype: Any) -> bool:
    """Whether `dtype`'s range is narrower than float32's (float16: yes; bfloat16: no)."""
    return bool(jnp.finfo(dtype).maxexp < jnp.finfo(np.float32).maxexp)


def _size(v: Any) -> int:
    return int(np.prod(v.aval.shape))


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _widest(dtypes: list[np.dtype]) -> np.dtype:
    best = dtypes[0]
    for d in dtypes[1:]:
        if d == best:
            continue
        if np.dtype(d).itemsize > np.dtype(best).itemsize:
            best = d
        elif np.dtype(d).itemsize == np.dtype(best).itemsize:
            best = np.dtype(np.float32)  # float16 meets bfloat16: neither holds the other
    return np.dtype(best)


def _max(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)


def _as(known: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """`known` and `known` cast to `dtype`, both as float64."""
    with np.errstate(all="ignore"):
        return np.asarray(known, np.float64), np.asarray(known).astype(dtype).astype(np.float64)


def _underflows(known: np.ndarray, dtype: np.dtype) -> bool:
    """Whether casting `known` to `dtype` turns a nonzero into zero (an epsilon of 1e-12)."""
    k, cast = _as(known, dtype)
    return bool(np.any((k != 0) & (cast == 0)))


def _changes_meaning(known: np.ndarray, dtype: np.dtype) -> bool:
    """Whether casting the trace-time constant `known` to `dtype` turns a finite value into an
    infinity or a nonzero into zero (a mask fill of -1e30, an epsilon of 1e-12 in float16)."""
    k, cast = _as(known, dtype)
    return bool(np.any(np.isfinite(k) & ~np.isfinite(cast))) or _underflows(known, dtype)


def _beyond(known: Any, dtype: np.dtype) -> bool:
    """Whether a value, `known` or not (None), may lie beyond `dtype`'s finite range."""
    return known is None or bool(np.any(np.abs(known[np.isfinite(known)]) > _max(dtype)))


def _op_lists(mode: Any) -> tuple[frozenset[str], frozenset[str]]:
    """The (lower, f32) op lists in force under `mode`."""
    if isinstance(mode, Policy) and mode.half and mode.level != "O0":
        return mode.lower_ops, mode.f32_ops
    return frozenset(), frozenset()


# -- what each value is used for ----------------------------------------------------------------
#
# A backward pass over a jaxpr marks each float value with two facts: it feeds a decision (a
# comparison, an integer convert, a sort, a loop condition), and it feeds only f32-list ops.
# Producers of the first keep their traced dtype; producers of the second compute in float32.
Flags = tuple[bool, bool]  # (feeds a decision, feeds only f32-list ops)
_NONE: Flags = (False, False)


def use_flags(eqn: Any, mode: Any, out_dec: bool, out_f32: bool) -> list[Flags]:
    """What a primitive equation's operands are used for, given its results' uses: they
    decide something (their results are integers, bools or an order), or feed only f32-list
    ops (through an elementwise op whose results do)."""
    name, n = eqn.primitive.name, len(eqn.invars)
    if name in _DECISION_OPS or not any(_is_float(v.aval.dtype) for v in eqn.outvars):
        return [(True, False)] * n  # floats that become integers, bools or bits decide
    lower, f32 = _op_lists(mode)
    if name not in ops.KNOWN_OPS and (name in SHAPE_OPS or name in _PASS_OPS):
        return [(out_dec, False)] * n  # a slice of a coordinate that is floored decides too
    if name in lower or name not in ops.KNOWN_OPS:
        return [_NONE] * n
    if name in f32:
        return [(out_dec, True)] * n
    return [(out_dec, out_f32)] * n


# -- the dtype each equation runs in --------------------------------------------------------------


def target_dtype(
    name: str,
    eqn: Any,
    vals: list[Any],
    mode: Any,
    base: Policy,
    held: list[int],
    static: list[bool],
    index: list[bool],
    known: list[Any],
    out_flags: list[Flags],
    bias_add: bool = False,
    feeds: list[bool] | None = None,
    carried: list[bool] | None = None,
) -> tuple[Any, int]:
    """The rule: the dtype float operands are cast to, and whether the result is held in float32.

    Returns (None, hold) to leave the operands as they are, ("traced", False) to run the op in
    the dtypes it was traced with, or (dtype, hold). `hold` is 0 or the kind of value held in
    float32: _STAT for f32-list results and what is computed only from them (at O2 they stay
    float32 until bulk math casts them down), _GUARD for float16 activations leaving a float32
    region (held for the range; ops that commute with a cast run on them in half).
    """
    fin = [i for i, v in enumerate(eqn.invars) if _is_float(v.aval.dtype)]
    if not fin:
        return None, False
    if name in SHAPE_OPS or name in _PASS_OPS:
        return None, max(held[i] for i in fin)
    if name in _TRACED_DTYPE_OPS or name not in ops.KNOWN_OPS:
        return "untouched", False  # unknown primitive: never wrong, only slower
    traced = [np.dtype(eqn.invars[i].aval.dtype) for i in fin]
    full = _widest([*traced, np.dtype(np.float32)])
    if mode == "f32":
        # Statistics made in the region (f32-list results and what is computed only from
        # them) stay held when they leave it. With bfloat16 (float32's range) its activations
        # (a norm's output) do not: at O2 the next bulk op runs in half and saves its
        # residuals in half, as apex's float32 BatchNorm hands half outputs on. float16's
        # range ends at 65504, so there they stay float32 until bulk math casts them down
        # (gelu's x**3 of a LayerNorm output of 50 overflows it).
        dyn = [i for i in fin if not static[i]]
        if name in ops.F32_OPS | base.f32_ops:
            return full, _STAT
        if dyn and all(held[i] for i in dyn):
            return full, min(held[i] for i in dyn)
        return full, _GUARD if _narrow(base.compute_dtype) else False
    if mode == "half":
        return base.compute_dtype, False
    policy: Policy = mode
    if policy.level == "O0" or not policy.half:
        return full, False
    if all(static):
        return "traced", False  # constants, index arithmetic, random numbers: as traced
    fouts = [v for v in eqn.outvars if _is_float(v.aval.dtype)]
    lower, f32 = _op_lists(policy)
    decides = name in _DECISION_OPS or not fouts or any(f[0] for f in out_flags)
    if name not in lower and (decides or all(not v.aval.shape for v in fouts)):
        return "traced", False  # decisions and scalar bookkeeping (tensor math follows policy)
    if name in CARRY_OPS and carried is not None and any(carried[i] for i in fin):
        # The loop's state updated by a small step keeps the dtype it entered the loop with.
        return _widest(traced), False
    strong_in = [
        i
        for i in fin
        if not isinstance(eqn.invars[i], jc.Literal) and not eqn.invars[i].aval.weak_type
    ]
    if name not in lower and strong_in and all(index[i] or static[i] for i in strong_in):
        return "traced", False  # index arithmetic: y - floor(y) for sampling coordinates
    if (
        name in _CANCELS
        and feeds is not None
        and any(index[i] and not static[i] for i in strong_in)
        and all(index[i] or static[i] or feeds[i] for i in strong_in)
    ):
        return "traced", False  # a coordinate minus its own floor: p - floor(p).astype(int)
    if name in f32 or (name not in lower and fouts and all(f[1] for f in out_flags)):
        return full, _STAT  # f32-list ops and the elementwise producers feeding only them
    hold: int = 0
    if name in lower:
        target = policy.compute_dtype
    else:
        # Weak-typed operands and literals (Python scalars in the source) do not promote, as in
        # jnp; at O2 neither do values computed without float inputs (constants, masks).
        floats = [
            (np.dtype(vals[i].dtype), isinstance(eqn.invars[i], jc.Literal), held[i], static[i])
            for i in fin
        ]
        floats = [
            (d, lit or eqn.invars[i].aval.weak_type, h, s)
            for (d, lit, h, s), i in zip(floats, fin, strict=True)
        ]
        if policy.level == "O1" and bias_add:
            # A matmul's bias is part of it, as in torch's nn.Linear and F.conv under autocast:
            # the half result stays half, instead of promoting every activation to float32.
            target, hold = policy.compute_dtype, False
        elif policy.level == "O1":
            strong = [f for f in floats if not f[1]] or floats
            target, hold = _widest([d for d, _, _, _ in strong]), False
        else:
            strong = [f for f in floats if not f[1] and not f[3]]
            kinds = [h for _, _, h, _ in strong]
            if any(kinds) and name in _CAST_COMMUTES and _STAT not in kinds:
                # relu of a float32 norm's output: the same as relu of its half cast, so it
                # runs in half and saves half residuals.
                target, hold = policy.compute_dtype, False
            elif any(kinds):
                # An f32 result meeting half values: the op runs in float32, so a sum of
                # squares plus an epsilon is not cast down before it divides.
                target, hold = full, min(kinds) if all(kinds) else False
            else:
                target, hold = policy.compute_dtype, False
    explicit = _explicit_half(eqn, fin, policy)
    if explicit is not None and np.dtype(target).itemsize < 4:
        target = explicit
    if np.dtype(target).itemsize < 4:
        bad = [k for k in known if k is not None and _changes_meaning(k, target)]
        if bad and name in _FILL_OPS and not any(_underflows(k, target) for k in bad):
            # A fill beyond the half's range (jnp.where(mask, x, finfo(float32).min)) keeps its
            # meaning saturated to the half's maximum, and the op stays in half.
            return target, hold
        if bad:
            return full, _STAT  # a constant half cannot hold: the op runs where it can
    return target, hold


def _explicit_half(eqn: Any, fin: list[int], policy: Policy) -> np.dtype | None:
    """The half dtype the program itself chose for this op, when it is not the policy's: every
    float operand (literals aside) was traced in it, as in a Flax module built with
    ``dtype=jnp.bfloat16`` under a float16 policy. Such a choice is honoured, as Keras honours
    a layer's own dtype policy (torch.amp overrides it)."""
    traced = {
        np.dtype(eqn.invars[i].aval.dtype) for i in fin if not isinstance(eqn.invars[i], jc.Literal)
    }
    if len(traced) != 1:
        return None
    (dtype,) = traced
    if dtype.itemsize == 2 and dtype != policy.compute_dtype:
        return dtype
    return None
