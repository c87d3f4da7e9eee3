"""Op-level autocast: trace a function to a jaxpr and evaluate it again, casting per op.

Lower-list ops (dot_general, conv) get half operands, f32-list ops (exp, log, reductions) get
float32 operands, and the rest follow their inputs at O1 (widest float wins, as torch's
promote list) or run in half at O2/O3. Regions marked with :func:`full_precision` or
:func:`half_precision` (``jax.named_scope`` markers, so they survive jit, grad and vmap)
override the policy, as do per-module rules of the Flax wrappers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mpjax._src import first_order, interpret, ops
from mpjax._src import jax_compat as jc
from mpjax._src.autocast_uses import Facts, analyze, while_facts
from mpjax._src.dtypes import is_float_dtype
from mpjax._src.first_order import (
    IN_RULE,
    NOT_REBUILT,
    bind_untouched,
    results,
    to_traced,
    untouched_reason,
)
from mpjax._src.islands import remat_islands
from mpjax._src.policy import Policy
from mpjax._src.regions import F32_REGION, HALF_REGION, MARKER, REGIONS
from mpjax._src.rules import NO_USE, Flags
from mpjax._src.values import (
    KNOWN_LIMIT,
    SHADOW_CACHE,
    InputFacts,
    Marks,
    Values,
    dynamic_leaves,
    fill_dynamic,
    is_value,
)


class UntouchedWarning(UserWarning):
    """A sub-program autocast meant to rebuild runs in its traced dtypes instead."""


# Calls inlined into the surrounding evaluation; custom-derivative calls, whose rules (jvp,
# fwd, bwd) run under the policy too; and the higher-order primitives rebuilt with autocast
# sub-jaxprs whose boundary dtypes are unchanged, so custom differentiation rules and
# loop-carry types stay valid (see mpjax._src.interpret for their layouts).
INLINE_CALLS = interpret.INLINE_CALLS
_CUSTOM_CALLS = frozenset(interpret.CUSTOM_CALLS)
_SUBJAXPR_PARAMS = interpret.BODY_PARAMS


class Context:
    """What the evaluation needs: the region policies by marker, the base policy, and a memo of
    the use analysis per sub-jaxpr."""

    def __init__(
        self,
        policy: Policy,
        regions: Mapping[str, Policy],
        rules: interpret.Rules | None = None,
        strict: bool = False,
    ):
        self.policy = policy
        # Raise instead of running a sub-program in its traced dtypes (autocast(strict=True)).
        self.strict = strict
        self.by_marker = {
            F32_REGION: "f32",
            HALF_REGION: "half",
            **regions,
        }
        self.memo: dict[Any, Any] = {}
        # The evaluation's rules by primitive (see RULES); mpjax.fp8 evaluates under an
        # extension of them that runs dot_general in FP8 and passes scales into bodies.
        self.rules: interpret.Rules = RULES if rules is None else rules

    def mode_for(self, inherited: Any, name_stack: str) -> Any:
        markers = [m for m in MARKER.findall(name_stack) if m in self.by_marker or m in REGIONS]
        if not markers:
            return inherited
        return self.by_marker.get(markers[-1]) or REGIONS[markers[-1]]


# -- machinery: evaluate a jaxpr, rebuilding higher-order primitives ------------------------------


def eval_jaxpr(
    ctx: Context,
    jaxpr: Any,
    consts: list[Any],
    args: list[Any],
    mode: Any,
    *,
    inputs: Sequence[InputFacts] | None = None,
    out_flags: tuple[Flags, ...] | None = None,
    traceback: Any = None,
) -> tuple[list[Any], list[int], list[Marks]]:
    """Evaluates `jaxpr` under the policy; returns its outputs, which are held in float32, and
    and their marks (see Values.marks).

    `inputs` are what the caller knows of the inputs (see InputFacts); None: nothing.

    `traceback`, for an inlined call, is the call site's: the inner equations' own may come from
    a cached trace made elsewhere.
    """
    facts = analyze(ctx, jaxpr, out_flags or (NO_USE,) * len(jaxpr.outvars), mode)
    env = Values()
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env.vals[v] = x
        env.static.add(v)
        if not (isinstance(x, jax.core.Tracer) and is_float_dtype(x.dtype)):
            env.inert.add(v)  # a tracer of an enclosing trace may be differentiated
        if isinstance(x, (np.ndarray, np.generic)) or (
            isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)  # keys: no numbers
        ):
            if np.size(x) <= KNOWN_LIMIT:
                env.known[v] = np.asarray(x)
    # An inlined call's inputs are params where the caller's operands are (a jitted loss's
    # logits are an activation, not a param table), the jaxpr's own inputs otherwise.
    known_of = inputs if inputs is not None else [InputFacts()] * len(jaxpr.invars)
    env.args.update(
        v
        for v, f in zip(jaxpr.invars, known_of, strict=True)
        if f.marks is None or f.marks.is_param is not False
    )
    for v, x, f in zip(jaxpr.invars, args, known_of, strict=True):
        env.vals[v] = x
        if f.static if f.static is not None else not is_float_dtype(v.aval.dtype):
            env.static.add(v)
        if f.held:
            env.held[v] = f.held
        if f.known is not None:
            env.known[v] = f.known
        if f.inert if f.inert is not None else v in env.static:
            env.inert.add(v)
        if f.marks is not None:
            env.mark(v, f.marks)

    def step(eqn: Any, invals: list[Any]) -> tuple[list[Any], list[int]]:
        name_stack = jc.current_name_stack() + eqn.source_info.name_stack
        eqn_mode = ctx.mode_for(mode, str(eqn.source_info.name_stack))
        tb = traceback if traceback is not None else eqn.source_info.traceback
        if traceback is not None and SHADOW_CACHE.get() and jc.summarize_source(eqn.source_info):
            tb = eqn.source_info.traceback  # see for_shadow: a body equation's own line
        with jc.user_context(tb, name_stack=name_stack):
            with eqn.ctx.manager:
                outvals, holds = ctx.rules(eqn)(ctx, eqn, invals, env, facts, eqn_mode, tb)
                # A region's mode is a string ("f32": a norm under the Flax wrappers).
                if len(outvals) == 1 and (not isinstance(eqn_mode, Policy) or eqn_mode.half):
                    outvals[0] = env.tag_island(eqn, invals, outvals[0])
        return outvals, holds

    outs = interpret.forward(jaxpr, env, step)
    return outs, [env.held_kind(v) for v in jaxpr.outvars], [env.marks(v) for v in jaxpr.outvars]


def _rebuild_closed(
    ctx: Context,
    closed: Any,
    mode: Any,
    flags: tuple[list[bool], list[int], tuple[Flags, ...] | None],
    context: Any = None,
    traceback: Any = None,
) -> Any:
    """The sub-jaxpr with autocast inside and its traced dtypes at the boundary."""
    body = _body_evaluator(ctx, closed, mode, flags, traceback)
    return trace_body(lambda *args: body(list(args)), list(closed.in_avals), context)


def _body_evaluator(
    ctx: Context, closed: Any, mode: Any, flags: Any, traceback: Any
) -> Callable[[list[Any]], list[Any]]:
    """Evaluates a sub-jaxpr under the policy and casts its outputs back to their traced dtypes
    (loop carries and custom rules need their boundary types unchanged)."""
    in_static, in_held, out_flags, in_carried = flags

    def body(args: list[Any]) -> list[Any]:
        outs, _, _ = eval_jaxpr(
            ctx,
            closed.jaxpr,
            list(closed.consts),
            args,
            mode,
            inputs=[
                InputFacts(static=st, held=h, marks=Marks(False, c, {}))
                for st, h, c in zip(in_static, in_held, in_carried, strict=True)
            ],
            out_flags=out_flags,
            traceback=traceback,
        )
        return to_traced(outs, closed.out_avals)

    return body


def trace_body(body: Callable[..., Any], avals: list[Any], context: Any = None) -> Any:
    """`body` traced at `avals` under autocast, its float32 islands made remat regions."""
    try:
        return remat_islands(jc.trace(body, avals, context), context)
    except ImportError as e:  # JAX internals moved (an AttributeError is a bug: it propagates)
        raise _CannotRebuild(str(e)) from None


_CannotRebuild = jc.CannotRebuild


def _rebuild_param(ctx: Context, value: Any, mode: Any, flags: Any, context: Any, tb: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_rebuild_param(ctx, v, mode, flags, context, tb) for v in value)
    if isinstance(value, jc.ClosedJaxpr):
        return _rebuild_closed(ctx, value, mode, flags, context, tb)
    if isinstance(value, jc.Jaxpr):
        if value.constvars:
            raise _CannotRebuild("open jaxpr with constvars")
        rebuilt = _rebuild_closed(ctx, jc.ClosedJaxpr(value, []), mode, flags, context, tb)
        if rebuilt.consts:
            raise _CannotRebuild("rebuilt jaxpr captured constants")
        return rebuilt.jaxpr
    return value


def _sub_flags(
    eqn: Any,
    key: str,
    static: list[bool],
    held: list[int],
    carried: list[bool],
    facts: Facts,
    ctx: Context,
    mode: Any,
) -> tuple[list[bool], list[int], tuple[Flags, ...] | None, list[bool]]:
    """What is known about a sub-jaxpr's inputs (static, held, carried) and its outputs' uses.

    A loop's carries are carried values in its body; a remat, cond or custom-rule body sees
    the facts of the operands it is called with (a scan over remat'ed layers adds inside)."""
    name = eqn.primitive.name
    n = len(eqn.invars)
    if name in _CUSTOM_CALLS or name in interpret.REMATS:
        return static, held, tuple(facts.flags(v) for v in eqn.outvars), carried
    if name == "cond":
        _, branch_static = interpret.cond_parts(eqn, static)
        _, branch_held = interpret.cond_parts(eqn, held)
        _, branch_carried = interpret.cond_parts(eqn, carried)
        return (
            branch_static,
            branch_held,
            tuple(facts.flags(v) for v in eqn.outvars),
            branch_carried,
        )
    if name == "scan":
        consts, carry, xs = interpret.scan_parts(eqn, range(n))
        k, rest = len(consts), n - len(consts)
        loop = [False] * k + [True] * len(carry) + [False] * len(xs)
        return static[:k] + [False] * rest, held[:k] + [False] * rest, None, loop
    if name == "while":
        cconsts, bconsts, carry = interpret.while_parts(eqn, range(n))
        cn, bn, nc = len(cconsts), len(bconsts), len(carry)
        if key == "cond_jaxpr":
            return static[:cn] + [False] * nc, held[:cn] + [False] * nc, None, [False] * (cn + nc)
        _, _, decided = while_facts(ctx, eqn, mode)
        out_flags = tuple(Flags(i in decided, False) for i in range(nc))
        body_static = static[cn : cn + bn] + [False] * nc
        return body_static, held[cn : cn + bn] + [False] * nc, out_flags, [False] * bn + [True] * nc
    return [False] * n, [False] * n, None, [False] * n


def _rule_wrapper(ctx: Context, mode: Any, held: list[int]) -> Callable[[Any], Any]:
    """Makes a custom-derivative rule (jvp, fwd, bwd) run under the policy, with its traced
    dtypes at the boundary, so that a function runs the same dtypes under jax.grad."""

    def wrap(rule: Any) -> Any:
        def run(*args: Any) -> Any:
            # Symbolic zeros (custom_jvp(symbolic_zeros=True), custom_vjp's fwd, equinox's
            # filter_custom_jvp/vjp, diffrax's adjoints) pass through as static values, in and
            # out; only arrays are traced and evaluated under the policy.
            dynamic = dynamic_leaves(args)
            passed: list[Any] = []

            def flat(*dyn: Any) -> Any:
                outs = list(rule.call_wrapped(*fill_dynamic(args, dynamic, dyn)))
                passed[:] = outs
                return [o for o in outs if is_value(o)]

            closed = jc.trace(flat, [jc.aval_of(args[i]) for i in dynamic])
            n, nin = len(dynamic), len(held)
            in_held = None
            if n == 2 * nin:  # a jvp rule: primals, then tangents
                in_held = held * 2
            elif n == nin:  # a forward rule: primals
                in_held = held

            def evaluate(*dyn: Any) -> list[Any]:
                outs, _, _ = eval_jaxpr(
                    ctx,
                    closed.jaxpr,
                    list(closed.consts),
                    list(dyn),
                    mode,
                    inputs=[InputFacts(static=False, held=h) for h in in_held or [0] * n],
                )
                return to_traced(outs, closed.out_avals)

            token = IN_RULE.set(True)
            try:  # traced, so that its float32 islands become remat regions
                rebuilt = trace_body(evaluate, list(closed.in_avals))
            finally:
                IN_RULE.reset(token)
            values = iter(jc.jaxpr_as_fun(rebuilt)(*[args[i] for i in dynamic]))
            return [next(values) if is_value(o) else o for o in passed]

        return jc.wrap_fun(rule, run)

    return wrap


def _bind_with_operands(
    ctx: Context, eqn: Any, invals: list[Any], mode: Any, flags: Any, tb: Any, extra: Any
) -> Any:
    """Binds a scan, remat or cond whose rebuilt bodies also take the operands `extra` gives:
    (consts, xs, enter). `consts` join a scan's constants (at the end of a remat's or a
    cond's operands, each branch entered in turn), `xs` (leading axis: the length; scan only)
    its scanned inputs, and `enter(consts, rows)`, given their values inside the body,
    returns a context manager held while the body is evaluated. mpjax.fp8 passes amax sinks
    into bodies this way: one row per iteration, so that scan's transpose stacks their
    cotangents, not sums."""
    consts, xs, enter = extra
    p = dict(eqn.params)
    name = eqn.primitive.name
    if name != "scan" and xs:
        raise ValueError("only a scan takes extra scanned operands")
    args = to_traced(invals, [v.aval for v in eqn.invars])
    nk, nx, n = len(consts), len(xs), len(eqn.invars)
    const_avals = [jc.aval_of(c) for c in consts]
    if name == "cond":  # each branch takes the operands (not the index), then `consts`
        branches = []
        for branch in p["branches"]:
            evaluate = _body_evaluator(ctx, branch, mode, flags, tb)

            def run(*a: Any, evaluate: Any = evaluate) -> list[Any]:
                with enter(list(a[n - 1 :]), []):
                    return evaluate(list(a[: n - 1]))

            branches.append(trace_body(run, [*branch.in_avals, *const_avals]))
        p["branches"] = tuple(branches)
        return jc.bind(eqn.primitive, args + list(consts), p)
    scan = name == "scan"
    closed = p["jaxpr"] if scan else jc.ClosedJaxpr(p["jaxpr"], [])
    nc = len(interpret.scan_parts(eqn, eqn.invars)[0]) if scan else n
    evaluate = _body_evaluator(ctx, closed, mode, flags, tb)

    def body(*a: Any) -> list[Any]:
        args_ = list(a)
        with enter(args_[nc : nc + nk], args_[nk + n :]):
            return evaluate(args_[:nc] + args_[nc + nk : nk + n])

    avals = list(closed.in_avals)
    avals[nc:nc] = const_avals
    avals += [jc.aval_of(x).update(shape=jc.aval_of(x).shape[1:]) for x in xs]
    rebuilt = trace_body(body, avals)
    if scan:
        p.update(jaxpr=rebuilt, num_consts=nc + nk)
        if "linear" in p:  # older JAX (0.6) records which operands are linear
            lin = tuple(p["linear"])
            p["linear"] = lin[:nc] + (False,) * nk + lin[nc:] + (False,) * nx
    else:
        if rebuilt.consts:
            raise _CannotRebuild("rebuilt jaxpr captured constants")
        p["jaxpr"] = rebuilt.jaxpr
    return jc.bind(eqn.primitive, args[:nc] + list(consts) + args[nc:] + list(xs), p)


def _eval_call(
    ctx: Context,
    body: tuple[Any, list[Any]],
    invals: list[Any],
    eqn: Any,
    env: Values,
    facts: Facts,
    mode: Any,
    tb: Any,
) -> tuple[list[Any], list[int], list[Marks]]:
    """Evaluates the body of a call equation (an inlined jit, a remat) on `invals`, with what
    the caller knows of its operands and of its results' uses."""
    jaxpr, consts = body  # the call's jaxpr and its constants
    static = [env.is_static(v) for v in eqn.invars]
    return eval_jaxpr(
        ctx,
        jaxpr,
        consts,
        invals,
        mode,
        inputs=[
            InputFacts(
                static=s,
                held=env.held_kind(v),
                known=env.known_value(v) if s else None,
                inert=env.is_inert(v),
                marks=env.marks(v),
            )
            for v, s in zip(eqn.invars, static, strict=True)
        ],
        out_flags=tuple(facts.flags(v) for v in eqn.outvars),
        traceback=tb,
    )


def _eval_remat(
    ctx: Context,
    eqn: Any,
    invals: list[Any],
    env: Values,
    facts: Facts,
    mode: Any,
    tb: Any,
) -> tuple[list[Any], list[int]]:
    """A user's remat (``jax.checkpoint``, ``nn.remat``, ``nnx.remat``), evaluated as an
    inlined call is, inside ``jax.checkpoint`` with its own policy: its operands and results
    keep the dtypes autocast gives them (a remat'ed layer of an O2 model takes and returns
    half, as the hand-written half step's, so what the remat saves, its inputs, is half), a
    name the user saved is saved in the dtype it has, and float32 islands inside are remat
    regions of their own."""
    p = eqn.params
    dyn = [i for i, x in enumerate(invals) if isinstance(x, jax.core.Tracer)]
    learnt: dict[str, Any] = {}

    def body(*d: Any) -> list[Any]:
        vals = list(invals)
        for i, x in zip(dyn, d, strict=True):
            vals[i] = x
        outs, holds, marks = _eval_call(ctx, (p["jaxpr"], []), vals, eqn, env, facts, mode, tb)
        learnt["holds"] = holds
        # Twins and island values made inside stay inside the remat's trace.
        learnt["marks"] = [Marks(m.is_index, m.is_carried, {}) for m in marks]
        return outs

    closed = trace_body(body, [jc.aval_of(invals[i]) for i in dyn])
    remat = jax.checkpoint(
        jc.jaxpr_as_fun(closed), policy=p.get("policy"), prevent_cse=p.get("prevent_cse", True)
    )
    outs = list(remat(*[invals[i] for i in dyn]))
    env.mark_results(eqn, learnt["marks"])
    return outs, learnt["holds"]


# -- the evaluation's rules --------------------------------------------------------------------
#
# Each rule evaluates one equation under the policy: (ctx, eqn, operand values, env, facts,
# mode, traceback) -> (result values, held kinds). Calls are inlined; user remats, loops,
# conds, custom-derivative calls and shard_map are rebuilt with autocast bodies; a higher-order
# primitive autocast does not know runs as traced; every other equation follows the
# first-order rules (first_order.py), which these extend. mpjax.fp8 extends these in turn
# (see Context.rules).
RULES = first_order.RULES.extend()


@RULES.register(*INLINE_CALLS)
def _inline_rule(
    ctx: Context, eqn: Any, invals: list[Any], env: Values, facts: Facts, mode: Any, tb: Any
) -> tuple[list[Any], list[int]]:
    closed = interpret.call_body(eqn, INLINE_CALLS)
    body = (closed.jaxpr, list(closed.consts))
    outs, holds, marks = _eval_call(ctx, body, invals, eqn, env, facts, mode, tb)
    # What the call's body learnt (an index made inside jnp.clip, the carry updated inside a
    # jitted step) holds for its results here too.
    env.mark_results(eqn, marks)
    return outs, holds


@RULES.register(*interpret.REMATS)
def _remat_rule(
    ctx: Context, eqn: Any, invals: list[Any], env: Values, facts: Facts, mode: Any, tb: Any
) -> tuple[list[Any], list[int]]:
    if not eqn.params.get("differentiated", True):
        return _eval_remat(ctx, eqn, invals, env, facts, mode, tb)
    return _rebuild_rule(ctx, eqn, invals, env, facts, mode, tb)


@RULES.register(*_CUSTOM_CALLS, "scan", "while", "cond", "shard_map")
def _rebuild_rule(
    ctx: Context, eqn: Any, invals: list[Any], env: Values, facts: Facts, mode: Any, tb: Any
) -> tuple[list[Any], list[int]]:
    name = eqn.primitive.name
    static, held, carried = env.operand_facts(eqn)
    try:
        params = dict(eqn.params)
        for key in _SUBJAXPR_PARAMS[name]:
            context = jc.shard_map_context(params) if name == "shard_map" else None
            flags = _sub_flags(eqn, key, static, held, carried, facts, ctx, mode)
            params[key] = _rebuild_param(ctx, params[key], mode, flags, context, tb)
        wrap = _rule_wrapper(ctx, mode, held) if name in _CUSTOM_CALLS else None
        args = to_traced(invals, [v.aval for v in eqn.invars])
        out = jc.bind(eqn.primitive, args, params, wrap_rule=wrap)
        return results(eqn, out)
    except _CannotRebuild as e:
        if name in interpret.REMATS:  # lose the remat, keep the precision
            outs, holds, _ = eval_jaxpr(ctx, eqn.params["jaxpr"], [], invals, mode, traceback=tb)
            return outs, holds
        why = f"autocast could not rebuild its body ({e})"
        _refuse_or_warn(ctx, eqn, why, warn=True)
        return results(eqn, bind_untouched(eqn, invals, NOT_REBUILT))


@RULES.set_higher_order
def _untouched_rule(
    ctx: Context, eqn: Any, invals: list[Any], env: Values, facts: Facts, mode: Any, tb: Any
) -> tuple[list[Any], list[int]]:
    """A higher-order primitive autocast does not know, or leaves alone by design: as traced."""
    name = eqn.primitive.name
    _refuse_or_warn(ctx, eqn, untouched_reason(name), warn=name not in ops.UNTOUCHED_OPS)
    out = bind_untouched(eqn, invals)
    return results(eqn, out)


def _refuse_or_warn(ctx: Context, eqn: Any, why: str, warn: bool) -> None:
    """A sub-program about to run in its traced dtypes: an error under strict=True, else a
    warning where autocast did not mean to leave it (the audit lists it either way)."""
    name = eqn.primitive.name
    where = jc.summarize_source(eqn.source_info)
    if ctx.strict:
        raise ValueError(
            f"autocast(strict=True): the {name} at {where} would run in its traced dtypes, "
            f"not under the policy: {why}. Leave strict off to run it as traced (the audit "
            "lists it under 'untouched'), or move it out of the function autocast wraps."
        )
    if warn:
        warnings.warn(
            f"mpjax.autocast: the {name} at {where} runs in its traced dtypes, not under the "
            f"policy: {why}. The audit lists it; autocast(..., strict=True) raises instead.",
            UntouchedWarning,
            stacklevel=2,
        )


def bind_with_bodies(
    ctx: Context,
    eqn: Any,
    invals: list[Any],
    env: Values,
    facts: Facts,
    mode: Any,
    tb: Any,
    extra: Any,
) -> tuple[list[Any], list[int]] | None:
    """A scan, remat or cond whose rebuilt bodies also take the operands `extra` gives (see
    _bind_with_operands; mpjax.fp8's rules pass FP8 scales into bodies this way), or None
    where the bodies cannot be rebuilt (the rules in force then run it as usual)."""
    key = "branches" if eqn.primitive.name == "cond" else "jaxpr"
    static, held, carried = env.operand_facts(eqn)
    flags = _sub_flags(eqn, key, static, held, carried, facts, ctx, mode)
    try:
        out = _bind_with_operands(ctx, eqn, invals, mode, flags, tb, extra)
    except _CannotRebuild:
        return None
    return list(out), [False] * len(eqn.outvars)
