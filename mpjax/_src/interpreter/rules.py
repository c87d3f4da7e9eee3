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

import enum
from typing import Any, Literal, NamedTuple, TypeGuard, Union

import jax
import numpy as np

from mpjax._src import jax_compat as jc
from mpjax._src import levels
from mpjax._src.dtypes import dtype_max, is_float_dtype, max_exponent
from mpjax._src.interpreter import ops
from mpjax._src.interpreter.ops import Trait
from mpjax._src.policy import Policy

# What an equation runs under: a policy, or a region's full precision ("f32", a norm under the
# Flax wrappers, mpjax.full_precision) or half ("half", mpjax.half_precision).
Mode = Union[Policy, Literal["f32", "half"]]  # noqa: UP007 (a runtime alias on Python 3.10)

# Ops that take operands of unrelated dtypes and pass them through.
PASS_OPS = ops.having(Trait.PASSES)
# Ops that only move data: they keep their input's dtype and the first computing consumer
# casts. Besides saving converts, this keeps backward reductions in float32: the transpose of
# broadcasting a float32 bias is a float32 sum of the half cotangent, not a half sum.
MOVE_OPS = ops.having(Trait.MOVES)
# Reductions whose result is one of their operand's values, exact in any float dtype.
_EXACT_REDUCTIONS = ops.having(Trait.EXACT)
# Elementwise ops that broadcast size-1 dimensions implicitly.
ELEMENTWISE = ops.having(Trait.ELEMENTWISE)
# Ops whose meaning depends on the bit width: always run in their traced dtype.
BIT_WIDTH_OPS = ops.having(Trait.BIT_WIDTH)
# Ops whose float operands only decide something (a bool, an index, an order): they and the
# values feeding them keep their traced dtype, so rounding cannot flip a decision.
DECISION_OPS = ops.having(Trait.DECIDES)


class Hold(enum.IntEnum):
    """Why a value is held in float32 (see :func:`target_dtype`); NONE where it is not."""

    NONE = 0
    GUARD = 1  # a float16 activation leaving a float32 region, held for float32's range
    STAT = 2  # a statistic: an f32-list result, or a value computed only from them


# Ops that commute with a cast down (a monotone rounding): relu(cast(x)) == cast(relu(x)).
_CAST_COMMUTES = ops.having(Trait.COMMUTES)
# Ops for which a constant operand is a fill or a bound: one beyond the half's range saturates.
FILL_OPS = ops.having(Trait.FILLS)
# Ops that combine a value that feeds a decision with the decision's result: p - floor(p)
# cancels to the fractional part, which the half rounding of p would lose (an interpolation
# weight rounded to a multiple of 1/8 for p up to 63 in bfloat16).
_CANCELS = ops.having(Trait.CANCELS)
# Ops that pass a loop-carried value on, updated: y - 9e-4 * y, acc.at[i].add(v), a masked
# step jnp.where(done, y, y_new). Run in the carry's traced dtype, the update is not lost
# below half an ulp of the carry (an explicit Euler step in bfloat16 never moves y).
CARRY_OPS = ops.having(Trait.CARRIES)


def _narrow(dtype: np.dtype) -> bool:
    """Whether `dtype`'s range is narrower than float32's (float16: yes; bfloat16: no)."""
    return max_exponent(dtype) < max_exponent(np.float32)


def n_elements(v: jc.Atom) -> int:
    return int(np.prod(jc.aval(v).shape))


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


def _exact_and_cast(known: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """`known` and `known` cast to `dtype`, both as float64."""
    with np.errstate(all="ignore"):
        return np.asarray(known, np.float64), np.asarray(known).astype(dtype).astype(np.float64)


def _underflows(known: np.ndarray, dtype: np.dtype) -> bool:
    """Whether casting `known` to `dtype` turns a nonzero into zero (an epsilon of 1e-12)."""
    k, cast = _exact_and_cast(known, dtype)
    return bool(np.any((k != 0) & (cast == 0)))


def _changes_meaning(known: np.ndarray, dtype: np.dtype) -> bool:
    """Whether casting the trace-time constant `known` to `dtype` turns a finite value into an
    infinity or a nonzero into zero (a mask fill of -1e30, an epsilon of 1e-12 in float16)."""
    k, cast = _exact_and_cast(known, dtype)
    return bool(np.any(np.isfinite(k) & ~np.isfinite(cast))) or _underflows(known, dtype)


def may_exceed(known: np.ndarray | None, dtype: np.dtype) -> bool:
    """Whether a value, `known` or not (None), may lie beyond `dtype`'s finite range."""
    return known is None or bool(np.any(np.abs(known[np.isfinite(known)]) > dtype_max(dtype)))


def op_lists(mode: Mode) -> tuple[frozenset[str], frozenset[str]]:
    """The (lower, f32) op lists in force under `mode`."""
    if isinstance(mode, Policy) and levels.casts(mode):
        return mode.lower_ops, mode.f32_ops
    return frozenset(), frozenset()


# -- what each level does beyond the dtype of an op ----------------------------------------------


def saturates_fills(mode: Mode) -> TypeGuard[Policy]:
    """Whether a fill's constant beyond the half's range is clamped to it (see
    Values.saturate_fills): at O3 the program runs as if written in half, where
    ``jnp.where(mask, x, finfo(dtype).min)`` fills with the half's minimum."""
    return isinstance(mode, Policy) and mode.half and levels.of(mode).all_half


def moves_half(mode: Mode) -> TypeGuard[Policy]:
    """Whether data movement of a float32 value also makes its half twin (see Values.move),
    so that a consumer casting it down moves half bytes, as ``.astype`` before it would."""
    return isinstance(mode, Policy) and levels.casts(mode)


def looks_up_half(mode: Mode) -> TypeGuard[Policy]:
    """Whether a lookup in a param table takes its rows in half even where a float32 op takes
    them (a norm): at O2/O3, where params are half, as apex casts the model."""
    return isinstance(mode, Policy) and mode.half and levels.of(mode).casts_model


class WideSums(NamedTuple):
    """Which backward sums a policy runs in float32 (see :meth:`of`)."""

    # Sums the backward pass makes of a broadcast half activation (a UNet's time embedding,
    # grouped-query attention's repeated keys) run in float32 at O1/O2: no gradient leaves
    # the device for them.
    activations: bool
    # Those of float32 values cast to half (a bias, a positional table, an embedding row) are
    # the gradients' own sums: they run in the policy's reduce dtype.
    grads: bool
    # The scatter-adds of half lookups (a gather's transpose): rows taken many times (a
    # frequent token's embedding) sum in float32 and round once, at O1/O2 (as torch's
    # embedding backward accumulates), not once per row in half; where the sum stays on one
    # device (see sums_stay_local, which half_grads.lookup asks only for such a gather).
    lookups: bool = False

    @classmethod
    def of(cls, mode: Mode, in_rule: bool = False) -> WideSums:
        """The sums `mode` widens; none of the gradients' own inside a custom-derivative rule
        (`in_rule`), where the float32 reductions that need a custom_vjp cannot run."""
        policy = mode if isinstance(mode, Policy) else None
        if policy is None or not policy.half:
            return cls(False, False)
        activations = levels.of(policy).widens_activation_sums
        grads = not in_rule and levels.casts(policy) and policy.gradient_dtype.itemsize >= 4
        return cls(activations, grads, activations and not in_rule)


def sums_stay_local() -> bool:
    """Whether a sum traced now runs on one device: there is one, or the trace is inside
    shard_map with every mesh axis manual (a cross-device sum is then the user's psum). Under
    jit's partitioner over several devices, a lookup's float32 scatter-add would have it sum
    the table's gradient across devices in float32, where the policy's reduce dtype says
    half, so there the scatter-add stays half, as the hand-written step's."""
    if jax.device_count() == 1:
        return True
    mesh = jax.sharding.get_abstract_mesh()
    return bool(mesh.axis_names) and set(mesh.manual_axes) == set(mesh.axis_names)


# -- what each value is used for ----------------------------------------------------------------
#
# A backward pass over a jaxpr marks each float value with two facts: it feeds a decision (a
# comparison, an integer convert, a sort, a loop condition), and it feeds only f32-list ops.
# Producers of the first keep their traced dtype; producers of the second compute in float32.
class Use(NamedTuple):
    """What a value is used for (see :func:`use_flags`)."""

    decides: bool  # it feeds a decision
    f32_only: bool  # it feeds only f32-list ops


NO_USE = Use(False, False)


def use_flags(eqn: jc.JaxprEqn, mode: Mode, out_dec: bool, out_f32: bool) -> list[Use]:
    """What a primitive equation's operands are used for, given its results' uses: they
    decide something (their results are integers, bools or an order), or feed only f32-list
    ops (through an elementwise op whose results do)."""
    name, n = eqn.primitive.name, len(eqn.invars)
    if name in DECISION_OPS or not any(is_float_dtype(jc.aval(v).dtype) for v in eqn.outvars):
        return [Use(True, False)] * n  # floats that become integers, bools or bits decide
    lower, f32 = op_lists(mode)
    if name in PASS_OPS or name == "broadcast_in_dim":
        # A softmax's row max, broadcast and stop_gradient'ed, that feeds only its exp: the
        # max is taken in float32 as well, inside the softmax's island (the same value: a
        # max is exact in any float dtype), so that XLA sees one softmax to fuse.
        return [Use(out_dec, out_f32)] * n
    if name not in ops.KNOWN_OPS and name in MOVE_OPS:
        return [Use(out_dec, False)] * n  # a slice of a coordinate that is floored decides too
    if name in _EXACT_REDUCTIONS:
        # ...but the max does not pull the scores' producer into float32: the island starts
        # where it started, at the half scores.
        return [Use(out_dec, False)] * n
    if name in lower or name not in ops.KNOWN_OPS:
        return [NO_USE] * n
    if name in f32:
        return [Use(out_dec, True)] * n
    return [Use(out_dec, out_f32)] * n


# -- the dtype each equation runs in --------------------------------------------------------------


class Action(enum.Enum):
    """What the rule does with an equation's float operands."""

    KEEP = "keep"  # leaves them as they are (data movement, no float operand)
    TRACED = "traced"  # casts them back to the dtypes the program traced
    UNTOUCHED = "untouched"  # as TRACED, for a primitive autocast leaves alone (marked)
    CAST = "cast"  # casts them to the decision's dtype


class Decision(NamedTuple):
    """The rule's decision for one equation (see :func:`target_dtype`)."""

    action: Action
    dtype: np.dtype | None = None  # for CAST: the dtype float operands are cast to
    hold: Hold = Hold.NONE  # whether, and why, the results are held in float32


class Operand(NamedTuple):
    """What the rule knows of one operand of an equation (see :func:`target_dtype`)."""

    held: int  # a Hold: whether, and why, it is held in float32
    static: bool  # computed without float inputs of the program (a constant, a mask)
    is_index: bool  # index arithmetic (an integer cast to float, a floor)
    known: np.ndarray | None  # its value when known at trace time and small, else None
    feeds: bool  # it (or its source) feeds a decision
    carried: bool  # a loop's carry passes through it


def target_dtype(
    name: str,
    eqn: jc.JaxprEqn,
    vals: list[jc.Value | np.ndarray],
    mode: Mode,
    base: Policy,
    operands: list[Operand],
    out_flags: list[Use],
    bias_add: bool = False,
) -> Decision:
    """The rule: the dtype float operands are cast to, and whether the result is held in float32.

    The decision's `hold` is NONE or the kind of value held in float32: STAT for f32-list
    results and what is computed only from them (at O2 they stay float32 until bulk math casts
    them down), GUARD for float16 activations leaving a float32 region (held for the range;
    ops that commute with a cast run on them in half).
    """
    floats_at = [i for i, v in enumerate(eqn.invars) if is_float_dtype(jc.aval(v).dtype)]
    if not floats_at:
        return Decision(Action.KEEP)
    held = [o.held for o in operands]
    static = [o.static for o in operands]
    if name in MOVE_OPS or name in PASS_OPS:
        return Decision(Action.KEEP, hold=Hold(max(held[i] for i in floats_at)))
    if name in BIT_WIDTH_OPS or name not in ops.KNOWN_OPS:
        return Decision(Action.UNTOUCHED)  # unknown primitive: never wrong, only slower
    traced = [np.dtype(jc.aval(eqn.invars[i]).dtype) for i in floats_at]
    full = _widest([*traced, np.dtype(np.float32)])
    if mode == "f32" or mode == "half":
        return _region_decision(name, mode, base, full, [(held[i], static[i]) for i in floats_at])
    policy: Policy = mode
    if not levels.casts(policy):
        return Decision(Action.CAST, full)
    if all(static):
        return Decision(Action.TRACED)  # constants, index arithmetic, random numbers: as traced
    fouts = [v for v in eqn.outvars if is_float_dtype(jc.aval(v).dtype)]
    lower, f32 = op_lists(policy)
    strong_in = [
        i
        for i in floats_at
        if not isinstance(eqn.invars[i], jc.Literal) and not jc.aval(eqn.invars[i]).weak_type
    ]
    as_traced = _as_traced(
        name, name in lower, fouts, out_flags, traced, floats_at, strong_in, operands
    )
    if as_traced is not None:
        return as_traced
    if name in f32 or (name not in lower and fouts and all(f.f32_only for f in out_flags)):
        # f32-list ops and the elementwise producers feeding only them
        return Decision(Action.CAST, full, Hold.STAT)
    if name in lower:
        target, hold = np.dtype(policy.compute_dtype), int(Hold.NONE)
    else:
        floats = _following(eqn, vals, operands, floats_at)
        target, hold = _follow_target(name, policy, floats, full, bias_add)
    explicit = _explicit_half(eqn, floats_at, policy)
    if explicit is not None and np.dtype(target).itemsize < 4:
        target = explicit
    return _keeping_constants(name, target, hold, full, [o.known for o in operands])


def _following(
    eqn: jc.JaxprEqn,
    vals: list[jc.Value | np.ndarray],
    operands: list[Operand],
    floats_at: list[int],
) -> list[_Operand]:
    """The float operands an op that follows its inputs reads: weak-typed operands and
    literals (Python scalars in the source) do not promote, as in jnp; at O2 neither do values
    computed without float inputs (constants, masks)."""
    return [
        _Operand(
            np.dtype(vals[i].dtype),
            isinstance(eqn.invars[i], jc.Literal) or jc.aval(eqn.invars[i]).weak_type,
            operands[i].held,
            operands[i].static,
        )
        for i in floats_at
    ]


def _region_decision(
    name: str, mode: str, base: Policy, full: Any, operands: list[tuple[int, bool]]
) -> Decision:
    """target_dtype inside a float32 region (`mode` "f32") or a half one ("half");
    `operands` are the float operands' (held, static)."""
    if mode == "half":
        return Decision(Action.CAST, np.dtype(base.compute_dtype))
    # Statistics made in the region (f32-list results and what is computed only from them)
    # stay held when they leave it. With bfloat16 (float32's range) its activations (a norm's
    # output) do not: at O2 the next bulk op runs in half and saves its residuals in half, as
    # apex's float32 BatchNorm hands half outputs on. float16's range ends at 65504, so there
    # they stay float32 until bulk math casts them down (gelu's x**3 of a LayerNorm output of
    # 50 overflows it).
    dyn = [h for h, is_static in operands if not is_static]
    if name in ops.F32_OPS | base.f32_ops:
        return Decision(Action.CAST, full, Hold.STAT)
    if dyn and all(dyn):
        return Decision(Action.CAST, full, Hold(min(dyn)))
    narrow = _narrow(np.dtype(base.compute_dtype))
    return Decision(Action.CAST, full, Hold.GUARD if narrow else Hold.NONE)


def _as_traced(
    name: str,
    is_lower: bool,
    fouts: list[jc.Var],
    out_flags: list[Use],
    traced: list[np.dtype],
    floats_at: list[int],
    strong_in: list[int],
    operands: list[Operand],
) -> Decision | None:
    """The decision for an op that runs in its traced dtype (decisions, bookkeeping, index
    arithmetic) or its loop carry's, else None."""
    index = [o.is_index for o in operands]
    static = [o.static for o in operands]
    decides = name in DECISION_OPS or not fouts or any(f.decides for f in out_flags)
    if not is_lower and (decides or all(not jc.aval(v).shape for v in fouts)):
        # decisions and scalar bookkeeping (tensor math follows the policy)
        return Decision(Action.TRACED)
    if name in CARRY_OPS and any(operands[i].carried for i in floats_at):
        # The loop's state updated by a small step keeps the dtype it entered the loop with.
        return Decision(Action.CAST, _widest(traced))
    if not is_lower and strong_in and all(index[i] or static[i] for i in strong_in):
        # index arithmetic: y - floor(y) for sampling coordinates
        return Decision(Action.TRACED)
    if (
        name in _CANCELS
        and any(index[i] and not static[i] for i in strong_in)
        and all(index[i] or static[i] or operands[i].feeds for i in strong_in)
    ):
        # a coordinate minus its own floor: p - floor(p).astype(int)
        return Decision(Action.TRACED)
    return None


def _follow_target(
    name: str, policy: Policy, floats: list[_Operand], full: Any, bias_add: bool
) -> tuple[np.dtype, int]:
    """(dtype, hold) of an op that follows its inputs (not on an op list), by level."""
    per_op = levels.of(policy).per_op
    if per_op and bias_add:
        # A matmul's bias is part of it, as in torch's nn.Linear and F.conv under autocast:
        # the half result stays half, instead of promoting every activation to float32.
        return np.dtype(policy.compute_dtype), Hold.NONE
    if per_op:
        strong = [f for f in floats if not f.weak] or floats
        return _widest([f.dtype for f in strong]), Hold.NONE
    kinds = [f.held for f in floats if not f.weak and not f.static]
    if any(kinds) and name in _CAST_COMMUTES and Hold.STAT not in kinds:
        # relu of a float32 norm's output: the same as relu of its half cast, so it runs in
        # half and saves half residuals.
        return np.dtype(policy.compute_dtype), Hold.NONE
    if any(kinds):
        # An f32 result meeting half values: the op runs in float32, so a sum of squares plus
        # an epsilon is not cast down before it divides.
        return full, min(kinds) if all(kinds) else Hold.NONE
    return np.dtype(policy.compute_dtype), Hold.NONE


def _keeping_constants(
    name: str, target: np.dtype, hold: int, full: np.dtype, known: list[np.ndarray | None]
) -> Decision:
    """CAST to `target`, unless a constant operand (`known`) cannot keep its meaning in it."""
    if np.dtype(target).itemsize < 4:
        bad = [k for k in known if k is not None and _changes_meaning(k, target)]
        if bad and name in FILL_OPS and not any(_underflows(k, target) for k in bad):
            # A fill beyond the half's range (jnp.where(mask, x, finfo(float32).min)) keeps its
            # meaning saturated to the half's maximum, and the op stays in half.
            return Decision(Action.CAST, target, Hold(hold))
        if bad:
            # a constant half cannot hold: the op runs where it can
            return Decision(Action.CAST, full, Hold.STAT)
    return Decision(Action.CAST, target, Hold(hold))


class _Operand(NamedTuple):
    """A float operand, as the promotion at O1 and O2 sees it."""

    dtype: np.dtype  # its dtype now
    weak: bool  # a literal or weak-typed (a Python scalar in the source): it does not promote
    held: int  # the Hold kind of a value held in float32
    static: bool  # computed without float inputs (a constant, a mask)


def _explicit_half(eqn: jc.JaxprEqn, floats_at: list[int], policy: Policy) -> np.dtype | None:
    """The half dtype the program itself chose for this op, when it is not the policy's: every
    float operand (literals aside) was traced in it, as in a Flax module built with
    ``dtype=jnp.bfloat16`` under a float16 policy. Such a choice is honoured, as Keras honours
    a layer's own dtype policy (torch.amp overrides it)."""
    traced: set[np.dtype[Any]] = {
        np.dtype(jc.aval(eqn.invars[i]).dtype)
        for i in floats_at
        if not isinstance(eqn.invars[i], jc.Literal)
    }
    if len(traced) != 1:
        return None
    (dtype,) = traced
    if dtype.itemsize == 2 and dtype != policy.compute_dtype:
        return dtype
    return None
