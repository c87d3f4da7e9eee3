"""Autocast's first-order rules: one equation under the dtype rule (rules.target_dtype).

Most primitives take the default rule: kept as they are (data movement), run as traced, or run
on their operands cast to the rule's dtype. A primitive that needs more has a rule of its own,
registered beside the default in :data:`RULES` (converts, broadcasts, gathers, matmuls), as
JAX registers one rule per primitive for each interpreter. The higher-order primitives (calls,
loops, conds, custom-derivative calls) extend these rules in ``autocast.py``; what each
primitive is (moves data, decides, fills, ...) is its record in ``ops.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from mpjax._src import jax_compat as jc
from mpjax._src.dtypes import is_float_dtype
from mpjax._src.interpreter import interpret, ops
from mpjax._src.interpreter.autocast_uses import Uses
from mpjax._src.interpreter.half_grads import dot_wide_grads, grows_half, lookup
from mpjax._src.interpreter.islands import as_island
from mpjax._src.interpreter.ops import Trait
from mpjax._src.interpreter.rules import (
    ELEMENTWISE,
    FILL_OPS,
    Action,
    Decision,
    Hold,
    Mode,
    Operand,
    WideSums,
    looks_up_half,
    moves_half,
    n_elements,
    op_lists,
    saturates_fills,
)
from mpjax._src.interpreter.rules import target_dtype as _target_dtype
from mpjax._src.interpreter.values import Results, Values, cast, params_at
from mpjax._src.policy import Policy


class RuleContext(Protocol):
    """What a first-order rule needs of autocast's evaluation context (autocast.Context)."""

    policy: Policy
    in_rule: bool  # a custom-derivative rule is being evaluated (see rules.WideSums.of)
    shadow: bool  # for mpjax.compare's float32 shadow (see autocast_api.for_shadow)


class Step(NamedTuple):
    """What an evaluation rule is given beside the operands' values: one equation's step."""

    ctx: RuleContext  # the evaluation's context (autocast.Context)
    eqn: jc.JaxprEqn
    env: Values  # what is known of each value so far
    uses: Uses  # the use analysis of the equation's jaxpr
    mode: Mode  # the policy or region mode it runs under
    tb: jc.Traceback | None  # where it was written (an inlined call's: the call site)


# An evaluation rule: (step, the operands' values) -> Results.
Rule = Callable[[Step, list[jc.Value]], Results]

# The first-order rules, by primitive. autocast.RULES extends them with the higher-order ones.
RULES = interpret.Registry()


class UntouchedWarning(UserWarning):
    """A sub-program autocast meant to run under the policy runs in its traced dtypes
    instead: a body it could not rebuild, or a fused kernel (Pallas, cuDNN) that fails with
    half operands. The audit lists each (``AuditReport.untouched``), with the reason;
    ``autocast(..., strict=True)`` raises instead of warning.

    Example:
      >>> import warnings, jax.numpy as jnp, mpjax
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("error", mpjax.UntouchedWarning)  # fail on any
      ...     warnings.simplefilter("ignore", mpjax.HardwareWarning)
      ...     y = mpjax.autocast(jnp.tanh, mpjax.Policy.from_level("O2"))(jnp.ones(2))
      >>> y.dtype
      dtype('float32')
    """


UNTOUCHED_SCOPE = "mpjax_untouched"
# The scope's suffix for a body autocast meant to rebuild and could not (see untouched_reason).
NOT_REBUILT = "not-rebuilt"
# ... for a fused kernel that failed when traced with half operands (see kernels.py).
NO_HALF_KERNEL = "no-half-operands"


def untouched_reason(prim: str, code: str = "") -> str:
    """Why autocast left `prim` in its traced dtypes, from its ``mpjax_untouched`` scope."""
    if code == NOT_REBUILT:
        return "autocast could not rebuild its body: it ran in its traced dtypes"
    if code == NO_HALF_KERNEL:
        return "a fused kernel that failed with half operands: it ran as written (float32)"
    return ops.UNTOUCHED_OPS.get(prim, "a primitive autocast does not know: runs as traced")


def _value(x: jc.Value, v: jc.Atom) -> jc.Value | np.ndarray:
    """`x` as something with a dtype and shape (literals are plain or typed Python scalars)."""
    return jc.literal_array(v) if isinstance(v, jc.Literal) else x


def to_traced(vals: list[jc.Value], avals: list[Any]) -> list[jc.Value]:
    out = []
    for x, aval in zip(vals, avals, strict=True):
        if hasattr(x, "dtype") and is_float_dtype(x.dtype) and x.dtype != aval.dtype:
            x = cast(x, aval.dtype, getattr(aval, "weak_type", False))
        out.append(x)
    return out


def bind_untouched(eqn: jc.JaxprEqn, invals: list[jc.Value], code: str = "") -> jc.Value:
    # Marked in the HLO metadata so that the audit can show where autocast stood aside, and why
    # (untouched_reason reads the scope back).
    suffix = f":{code}" if code else ""
    with jax.named_scope(f"{UNTOUCHED_SCOPE}:{eqn.primitive.name}{suffix}"):
        out: jc.Value = jc.bind(
            eqn.primitive, to_traced(invals, [v.aval for v in eqn.invars]), eqn.params
        )
        return out


def results(eqn: jc.JaxprEqn, out: jc.Value, hold: int = Hold.NONE) -> Results:
    """A rule's return: `eqn`'s result values as a list, each held as `hold`."""
    return (list(out) if eqn.primitive.multiple_results else [out]), [hold] * len(eqn.outvars)


@RULES.set_default
def _primitive_rule(step: Step, invals: list[jc.Value]) -> Results:
    """A first-order equation under the dtype rule (rules.target_dtype)."""
    return _apply(step, invals, _cast_and_bind)


def _apply(
    step: Step,
    invals: list[jc.Value],
    cast_and_bind: Callable[..., Results],
    keep_bind: Callable[[list[jc.Value], WideSums], jc.Value] | None = None,
) -> Results:
    """`eqn` as rules.target_dtype decides: kept as it is (data movement, by `keep_bind` if
    given), as traced, or run by `cast_and_bind` on its operands cast to the decision's dtype
    (see _cast_and_bind)."""
    ctx, eqn, env, uses, mode, _ = step
    if eqn.primitive.name in FILL_OPS and saturates_fills(mode):
        invals = env.saturate_fills(eqn, invals, np.dtype(mode.compute_dtype))
    vals = [_value(x, v) for x, v in zip(invals, eqn.invars, strict=True)]
    decision = _decide(ctx, eqn, vals, env, uses, mode)
    wide_sums = WideSums.of(mode, ctx.in_rule)
    if decision.action is Action.KEEP:
        return results(eqn, _keep(eqn, invals, env, mode, wide_sums, keep_bind), decision.hold)
    if decision.action is Action.UNTOUCHED:
        return results(eqn, bind_untouched(eqn, invals), decision.hold)
    if decision.action is Action.TRACED:
        env.mark_results(eqn, index=True)
        traced = to_traced(invals, [v.aval for v in eqn.invars])
        return results(eqn, jc.bind(eqn.primitive, traced, eqn.params), decision.hold)
    return cast_and_bind(eqn, vals, invals, env, mode, decision, wide_sums)


def _decide(
    ctx: RuleContext,
    eqn: jc.JaxprEqn,
    vals: list[jc.Value | np.ndarray],
    env: Values,
    uses: Uses,
    mode: Mode,
) -> Decision:
    """rules.target_dtype's decision for `eqn`, from what `env` and `uses` know of its
    operands and results."""
    name = eqn.primitive.name
    facts_of = []
    for v in eqn.invars:
        static = env.is_static(v)
        facts_of.append(
            Operand(
                held=env.held_kind(v),
                static=static,
                is_index=env.is_index(v),
                known=env.known_value(v) if static else None,
                feeds=uses.of(v).decides or uses.of(env.source(v)).decides,
                carried=env.is_carried(v),
            )
        )
    return _target_dtype(
        name,
        eqn,
        vals,
        mode,
        ctx.policy,
        facts_of,
        [uses.of(v) for v in eqn.outvars],
        bias_add=name == "add" and env.is_bias_add(eqn),
    )


def _keep(
    eqn: jc.JaxprEqn,
    invals: list[jc.Value],
    env: Values,
    mode: Mode,
    wide_sums: WideSums,
    bind: Callable[[list[jc.Value], WideSums], jc.Value] | None = None,
) -> Any:
    """`eqn` (data movement) on its operands as they are, in their dtypes, by `bind` (`eqn`'s
    primitive if None; see _gather_rule)."""
    param = bool(eqn.invars) and env.is_param(eqn.invars[0])
    if (wide_sums.activations or (wide_sums.grads and param)) and grows_half(eqn, invals):
        # A broadcast that grows a half value: its transpose sums the cotangent over the new
        # axes (a diffusion UNet's time embedding, grouped-query attention's repeated keys).
        # Broadcast in float32, so that sum accumulates in float32; forward, the converts fuse.
        x = jc.convert(invals[0], np.float32)
        return jc.convert(jc.bind(eqn.primitive, [x, *invals[1:]], eqn.params), invals[0].dtype)
    out = jc.bind(eqn.primitive, invals, eqn.params) if bind is None else bind(invals, wide_sums)
    if eqn.primitive.name in _CAST_FIRST_OPS and moves_half(mode):
        env.move(eqn, invals, np.dtype(mode.compute_dtype), wide_sums.grads, wide_sums.lookups)
    return out


def _cast_and_bind(
    eqn: jc.JaxprEqn,
    vals: list[jc.Value],
    invals: list[jc.Value],
    env: Values,
    mode: Mode,
    decision: Decision,
    wide_sums: WideSums,
    bind: Callable[..., Any] | None = None,
) -> Results:
    """`eqn` on its float operands cast to the decision's dtype, by `bind` (`eqn`'s primitive
    if None; see _dot_rule): its results and their holds."""
    name, target, hold = eqn.primitive.name, decision.dtype, decision.hold
    assert target is not None  # a CAST decision has its dtype
    out_shape = tuple(jc.aval(eqn.outvars[0]).shape) if name in ELEMENTWISE else None
    sharding = jc.typed_sharding(eqn.outvars[0].aval) if out_shape is not None else None
    cast_vals = [
        env.cast(
            v,
            x,
            target,
            out_shape if out_shape is not None else tuple(x.shape),
            wide_sums.grads
            if x.dtype == np.float32
            else wide_sums.activations or (wide_sums.grads and env.is_param(v)),
            sharding,
        )
        if hasattr(x, "dtype") and is_float_dtype(x.dtype) and is_float_dtype(jc.aval(v).dtype)
        else raw
        for x, raw, v in zip(vals, invals, eqn.invars, strict=True)
    ]
    params = params_at(eqn, target)
    if bind is None:
        out = jc.bind(eqn.primitive, cast_vals, params)
    else:
        out = bind(eqn, vals, cast_vals, params, env, np.dtype(target), wide_sums)
    if params.get("preferred_element_type") not in (None, np.dtype(target)):
        hold = Hold.STAT  # a float32 result the program asked for stays float32, as a statistic
    elif name in op_lists(mode)[0]:
        env.mark_results(eqn, lowered=True)
    return results(eqn, out, hold)


# -- the primitives with rules of their own -------------------------------------------------


@RULES.register("convert_element_type")
def _convert_rule(step: Step, invals: list[jc.Value]) -> Results:
    """A convert from an integer or a bool makes an index (see Values.index); one between
    floats converts to the dtype the rule decides, the traced target's where it casts."""
    eqn, env = step.eqn, step.env
    if not is_float_dtype(jc.aval(eqn.invars[0]).dtype):
        env.mark_results(eqn, index=True)
    return _apply(step, invals, _convert)


def _convert(
    eqn: jc.JaxprEqn, vals: list[jc.Value], invals: list[jc.Value], env: Values, *_: Any
) -> Results:
    src, dst = jc.aval(eqn.invars[0]).dtype, eqn.params["new_dtype"]
    if src == dst and is_float_dtype(dst):  # a weak-type change only: keep the current dtype
        return [invals[0]], [env.held_kind(eqn.invars[0])]
    return results(eqn, jc.bind(eqn.primitive, invals, eqn.params))


@RULES.register("broadcast_in_dim")
def _broadcast_rule(step: Step, invals: list[jc.Value]) -> Results:
    """A broadcast under the dtype rule; one that grows its operand is recorded as spread, so
    that adding it to a matmul's result is a bias add (see Values.is_bias_add)."""
    eqn, env = step.eqn, step.env
    out = _apply(step, invals, _cast_and_bind)
    if n_elements(eqn.outvars[0]) > n_elements(eqn.invars[0]):
        env.mark_results(eqn, spread=True)
    return out


@RULES.register("gather")
def _gather_rule(step: Step, invals: list[jc.Value]) -> Results:
    """A gather under the dtype rule; a lookup in a param table at O2/O3 takes its rows in
    half (rules.looks_up_half), even where a float32 op (a norm) takes them, so the lookup and
    the collectives on it move half bytes. Rows a comparison reads (a decision) keep float32."""
    eqn, env, uses, mode = step.eqn, step.env, step.uses, step.mode
    cast_and_bind = functools.partial(_cast_and_bind, bind=_bind_gather)
    keep = lambda vals, wide_sums: lookup(eqn.params, vals[0], vals[1], wide_sums.lookups)
    outs, holds = _apply(step, invals, cast_and_bind, keep)
    out = eqn.outvars[0]
    if looks_up_half(mode) and env.is_param(eqn.invars[0]) and not uses.of(out).decides:
        facts = env.facts(out)
        twin = facts.twins.get(np.dtype(mode.compute_dtype))
        if twin is not None:
            # Rows of half values (see Values.move), cast up: a float32 island starts here.
            facts.island = True
            outs[0] = as_island(jc.convert(twin, outs[0].dtype))
    return outs, holds


def _bind_gather(
    eqn: jc.JaxprEqn,
    vals: list[jc.Value],
    cast_vals: list[jc.Value],
    params: dict[str, Any],
    env: Values,
    target: np.dtype,
    wide_sums: WideSums,
) -> Any:
    """half_grads.lookup on the operands cast to the decision's dtype."""
    return lookup(params, cast_vals[0], cast_vals[1], wide_sums.lookups)


@RULES.register("dot_general")
def _dot_rule(step: Step, invals: list[jc.Value]) -> Results:
    """A matmul under the dtype rule; where the policy reduces gradients in float32, that of a
    param comes out of the half matmul in float32 (see _bind_wide_grads)."""
    cast_and_bind = functools.partial(_cast_and_bind, bind=_bind_wide_grads)
    return _apply(step, invals, cast_and_bind)


def _bind_wide_grads(
    eqn: jc.JaxprEqn,
    vals: list[jc.Value],
    cast_vals: list[jc.Value],
    params: dict[str, Any],
    env: Values,
    target: np.dtype,
    wide_sums: WideSums,
) -> Any:
    """A half matmul whose float32 operands that are inputs of the program (a weight, moved
    by reshapes at most) get float32 gradients: the matmul runs in half, and the gradient of
    such an operand comes out of a half matmul that writes float32, so its sum over the batch,
    and the all-reduce a partitioner puts on it, are float32."""
    wide_dot = [
        wide_sums.grads
        and target.itemsize < 4
        and is_float_dtype(getattr(x, "dtype", np.int32))
        and not env.is_static(v)
        and env.is_param(v)
        for x, v in zip(vals, eqn.invars, strict=True)
    ]
    if not any(wide_dot) or params.get("preferred_element_type") not in (None, target):
        return jc.bind(eqn.primitive, cast_vals, params)
    operands = [x if w else c for x, c, w in zip(vals, cast_vals, wide_dot, strict=True)]
    avals = tuple(jc.aval_of(x) for x in operands)
    return dot_wide_grads(params, target, tuple(wide_dot), avals)(*operands)


# Data movement: a cast commutes with it, so it can run on the half cast (see Values.move).
# Resharding ops move the value between devices (.at[].get(out_sharding=) is a gather, then
# a reshard; on JAX 0.6 a gather between two mesh_casts).
_CAST_FIRST_OPS = ops.having(Trait.CAST_FIRST)
