"""Op-level autocast: trace a function to a jaxpr and evaluate it again, casting per op.

Lower-list ops (dot_general, conv) get half operands, f32-list ops (exp, log, reductions) get
float32 operands, and the rest follow their inputs at O1 (widest float wins, as torch's
promote list) or run in half at O2/O3. Regions marked with :func:`full_precision` or
:func:`half_precision` (``jax.named_scope`` markers, so they survive jit, grad and vmap)
override the policy, as do per-module rules of the Flax wrappers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from mpjax._src import jax_compat as jc
from mpjax._src.dtypes import is_float_dtype
from mpjax._src.interpreter import first_order, interpret, kernels, ops
from mpjax._src.interpreter.autocast_uses import Uses, analyze, while_facts
from mpjax._src.interpreter.first_order import (
    NOT_REBUILT,
    Rule,
    Step,
    UntouchedWarning,
    bind_untouched,
    results,
    to_traced,
    untouched_reason,
)
from mpjax._src.interpreter.islands import remat_islands, tangents_inside
from mpjax._src.interpreter.regions import F32_REGION, HALF_REGION, MARKER, REGIONS
from mpjax._src.interpreter.rules import NO_USE, Hold, Mode, Use
from mpjax._src.interpreter.values import (
    KNOWN_LIMIT,
    Results,
    ValueFacts,
    Values,
    dynamic_leaves,
    fill_dynamic,
    is_value,
)
from mpjax._src.policy import Policy


class Context:
    """What the evaluation needs: the region policies by marker, the base policy, and a memo of
    the use analysis per sub-jaxpr; whether a custom-derivative rule is being evaluated
    (`in_rule`) and whether for mpjax.compare's float32 shadow (`shadow`, see
    autocast_api.for_shadow)."""

    def __init__(
        self,
        policy: Policy,
        regions: Mapping[str, Policy],
        rules: interpret.Registry | None = None,
        strict: bool = False,
    ):
        self.policy = policy
        # Raise instead of running a sub-program in its traced dtypes (autocast(strict=True)).
        self.strict = strict
        self.by_marker: dict[str, Mode] = {
            F32_REGION: "f32",
            HALF_REGION: "half",
            **regions,
        }
        self.memo: dict[Any, Any] = {}
        # The evaluation's rules by primitive (see RULES); mpjax.fp8 evaluates under an
        # extension of them that runs dot_general in FP8 and passes scales into bodies.
        self.rules: interpret.Registry = RULES if rules is None else rules
        # A custom-derivative rule runs under the policy: JAX differentiates a jvp rule by
        # linearizing and transposing it, which a custom_vjp inside cannot take, so the float32
        # reductions that need one (dot_wide_grads, gather_half) keep JAX's own rules there.
        self.in_rule = False
        # For a float32 shadow: constants cast down stay converts of their values, and an
        # inlined call's equations keep their own source lines.
        self.shadow = False

    def replace(self, **changes: bool) -> Context:
        """This context with `changes` (``in_rule=True``, ``shadow=True``); the memo shared."""
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    def mode_for(self, inherited: Mode, name_stack: str) -> Mode:
        """The mode an equation with `name_stack` runs under: that of its innermost region
        marker, else `inherited`."""
        markers = [m for m in MARKER.findall(name_stack) if m in self.by_marker or m in REGIONS]
        if not markers:
            return inherited
        return self.by_marker.get(markers[-1]) or REGIONS[markers[-1]]


# -- machinery: evaluate a jaxpr, rebuilding higher-order primitives ------------------------------


def eval_jaxpr(
    ctx: Context,
    jaxpr: jc.Jaxpr,
    consts: list[jc.Value],
    args: list[jc.Value],
    mode: Mode,
    *,
    inputs: Sequence[ValueFacts] | None = None,
    out_flags: tuple[Use, ...] | None = None,
    traceback: jc.Traceback | None = None,
) -> tuple[list[jc.Value], list[int], list[ValueFacts]]:
    """Evaluates `jaxpr` under the policy; returns its outputs, which of them are held in
    float32, and what it hands back of each (see Values.handed).

    `inputs` are what the caller knows of the inputs (see ValueFacts); None: nothing.

    `traceback`, for an inlined call, is the call site's: the inner equations' own may come from
    a cached trace made elsewhere.
    """
    uses = analyze(ctx, jaxpr, out_flags or (NO_USE,) * len(jaxpr.outvars), mode)
    env = Values(keep_constants=ctx.shadow)
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env.vals[v] = x
        f = env.facts(v)
        f.static = True
        # a tracer of an enclosing trace may be differentiated
        f.inert = not (isinstance(x, jax.core.Tracer) and is_float_dtype(x.dtype))
        if isinstance(x, (np.ndarray, np.generic)) or (
            isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)  # keys: no numbers
        ):
            if np.size(x) <= KNOWN_LIMIT:
                f.known = np.asarray(x)
    # An inlined call's inputs are params where the caller's operands are (a jitted loss's
    # logits are an activation, not a param table), the jaxpr's own inputs otherwise.
    known_of = inputs if inputs is not None else [ValueFacts()] * len(jaxpr.invars)
    for v, x, known in zip(jaxpr.invars, args, known_of, strict=True):
        env.enter(v, x, known)

    def step(eqn: jc.JaxprEqn, invals: list[jc.Value]) -> Results:
        name_stack = jc.current_name_stack() + eqn.source_info.name_stack
        where = str(eqn.source_info.name_stack)
        eqn_mode = ctx.mode_for(mode, where)
        tb = traceback if traceback is not None else eqn.source_info.traceback
        if traceback is not None and ctx.shadow and jc.summarize_source(eqn.source_info):
            tb = eqn.source_info.traceback  # see for_shadow: a body equation's own line
        with jc.user_context(tb, name_stack=name_stack):
            with eqn.ctx.manager:
                kernel = _kernel_step(eqn, invals, where)
                if kernel is not None:
                    return kernel
                rule: Rule = ctx.rules(eqn)
                outvals, holds = rule(Step(ctx, eqn, env, uses, eqn_mode, tb), invals)
                # A region's mode is a string ("f32": a norm under the Flax wrappers).
                if len(outvals) == 1 and (not isinstance(eqn_mode, Policy) or eqn_mode.half):
                    outvals[0] = env.tag_island(eqn, invals, outvals[0])
        return outvals, holds

    outs = interpret.forward(jaxpr, env, step)
    return outs, [env.held_kind(v) for v in jaxpr.outvars], [env.handed(v) for v in jaxpr.outvars]


def _kernel_step(eqn: jc.JaxprEqn, invals: list[jc.Value], where: str) -> Results | None:
    """A fused kernel's equation (see kernels.py), `where` its name stack: its half call as
    traced, the casts of its results back to float32 passed on in half; None for any other
    equation."""
    if kernels.RESULT in where:
        return list(invals), [Hold.NONE] * len(eqn.outvars)
    if kernels.KERNEL in where:
        args = to_traced(invals, [v.aval for v in eqn.invars])
        return results(eqn, jc.bind(eqn.primitive, args, eqn.params))
    return None


def _rebuild_closed(
    ctx: Context,
    closed: jc.ClosedJaxpr,
    mode: Mode,
    body_facts: BodyFacts,
    context: Any = None,
    traceback: jc.Traceback | None = None,
) -> Any:
    """The sub-jaxpr with autocast inside and its traced dtypes at the boundary."""
    body = _body_evaluator(ctx, closed, mode, body_facts, traceback)
    return trace_body(lambda *args: body(list(args)), list(closed.in_avals), context)


def _body_evaluator(
    ctx: Context,
    closed: jc.ClosedJaxpr,
    mode: Mode,
    body_facts: BodyFacts,
    traceback: jc.Traceback | None,
) -> Callable[[list[jc.Value]], list[jc.Value]]:
    """Evaluates a sub-jaxpr under the policy and casts its outputs back to their traced dtypes
    (loop carries and custom rules need their boundary types unchanged)."""

    def body(args: list[jc.Value]) -> list[jc.Value]:
        outs, _, _ = eval_jaxpr(
            ctx,
            closed.jaxpr,
            list(closed.consts),
            args,
            mode,
            inputs=body_facts.inputs,
            out_flags=body_facts.out_uses,
            traceback=traceback,
        )
        return to_traced(outs, closed.out_avals)

    return body


def trace_body(
    body: Callable[..., list[jc.Value]], avals: list[jc.AbstractValue], context: Any = None
) -> jc.ClosedJaxpr:
    """`body` traced at `avals` under autocast, its float32 islands made remat regions."""
    try:
        return remat_islands(jc.trace(body, avals, context), context)
    except ImportError as e:  # JAX internals moved (an AttributeError is a bug: it propagates)
        raise _CannotRebuild(str(e)) from None


_CannotRebuild = jc.CannotRebuild


def _rebuild_param(
    ctx: Context,
    value: Any,
    mode: Mode,
    body_facts: BodyFacts,
    context: Any,
    tb: jc.Traceback | None,
) -> Any:
    if isinstance(value, tuple):
        return tuple(_rebuild_param(ctx, v, mode, body_facts, context, tb) for v in value)
    if isinstance(value, jc.ClosedJaxpr):
        return _rebuild_closed(ctx, value, mode, body_facts, context, tb)
    if isinstance(value, jc.Jaxpr):
        if value.constvars:
            raise _CannotRebuild("open jaxpr with constvars")
        rebuilt = _rebuild_closed(ctx, jc.ClosedJaxpr(value, []), mode, body_facts, context, tb)
        if rebuilt.consts:
            raise _CannotRebuild("rebuilt jaxpr captured constants")
        return rebuilt.jaxpr
    return value


class BodyFacts(NamedTuple):
    """What a body's evaluation is told: what is known of each of its inputs, and what its
    outputs are used for (None: nothing is known)."""

    inputs: list[ValueFacts]
    out_uses: tuple[Use, ...] | None


def _body_facts(
    eqn: jc.JaxprEqn, key: str, env: Values, uses: Uses, ctx: Context, mode: Mode
) -> BodyFacts:
    """What is known of the inputs of `eqn`'s body `key` (static, held, carried) and of its
    outputs' uses: the rule of `eqn`'s primitive in _BODY_FACTS."""
    operands = [
        ValueFacts(static=env.is_static(v), held=env.held_kind(v), carried=env.is_carried(v))
        for v in eqn.invars
    ]
    results_used = tuple(uses.of(v) for v in eqn.outvars)
    return _BODY_FACTS(eqn)(eqn, key, operands, results_used, ctx, mode)  # type: ignore[no-any-return]


# What each body of a higher-order primitive is told, one rule per primitive: (eqn, body
# param, what is known of the operands, the results' uses, ctx, mode) -> BodyFacts. A remat,
# cond or custom-rule body sees the facts of the operands it is called with (a scan over
# remat'ed layers adds inside); a loop's carries are carried values in its body; any other
# body (shard_map's, per shard) is told nothing.
_FRESH, _CARRY = ValueFacts(static=False), ValueFacts(static=False, carried=True)
_BODY_FACTS = interpret.Registry(
    default=lambda eqn, key, operands, results_used, ctx, mode: BodyFacts(
        [_FRESH] * len(eqn.invars), None
    )
)


def _not_carried(facts: list[ValueFacts]) -> list[ValueFacts]:
    return [dataclasses.replace(f, carried=False) for f in facts]


@_BODY_FACTS.register(*interpret.CUSTOM_JVP.names, *interpret.CUSTOM_VJP.names)
@_BODY_FACTS.register(*interpret.REMAT.names)
def _called_facts(
    eqn: jc.JaxprEqn,
    key: str,
    operands: list[ValueFacts],
    results_used: tuple[Use, ...] | None,
    ctx: Context,
    mode: Mode,
) -> BodyFacts:
    return BodyFacts(operands, results_used)


@_BODY_FACTS.register(*interpret.COND.names)
def _branch_facts(
    eqn: jc.JaxprEqn,
    key: str,
    operands: list[ValueFacts],
    results_used: tuple[Use, ...] | None,
    ctx: Context,
    mode: Mode,
) -> BodyFacts:
    return BodyFacts(interpret.cond_parts(eqn, operands)[1], results_used)


@_BODY_FACTS.register(*interpret.SCAN.names)
def _scan_facts(
    eqn: jc.JaxprEqn,
    key: str,
    operands: list[ValueFacts],
    results_used: tuple[Use, ...] | None,
    ctx: Context,
    mode: Mode,
) -> BodyFacts:
    consts, carries, xs = interpret.scan_parts(eqn, operands)
    return BodyFacts([*_not_carried(consts), *[_CARRY] * len(carries), *[_FRESH] * len(xs)], None)


@_BODY_FACTS.register(*interpret.WHILE.names)
def _while_facts(
    eqn: jc.JaxprEqn,
    key: str,
    operands: list[ValueFacts],
    results_used: tuple[Use, ...] | None,
    ctx: Context,
    mode: Mode,
) -> BodyFacts:
    cconsts, bconsts, carries = interpret.while_parts(eqn, operands)
    if key == interpret.WHILE_CONDITION:
        return BodyFacts([*_not_carried(cconsts), *[_FRESH] * len(carries)], None)
    _, _, decided = while_facts(ctx, eqn, mode)
    out_uses = tuple(Use(i in decided, False) for i in range(len(carries)))
    return BodyFacts([*_not_carried(bconsts), *[_CARRY] * len(carries)], out_uses)


def _rule_wrapper(ctx: Context, mode: Mode, held: list[int]) -> Callable[[Any], Any]:
    """Makes a custom-derivative rule (jvp, fwd, bwd) run under the policy, with its traced
    dtypes at the boundary, so that a function runs the same dtypes under jax.grad."""

    def wrap(rule: Any) -> Any:
        def run(*args: jc.Value) -> Any:
            # Symbolic zeros (custom_jvp(symbolic_zeros=True), custom_vjp's fwd, equinox's
            # filter_custom_jvp/vjp, diffrax's adjoints) pass through as static values, in and
            # out; only arrays are traced and evaluated under the policy.
            dynamic = dynamic_leaves(args)
            passed: list[Any] = []  # arrays, and symbolic zeros passed through

            def flat(*arrays: jc.Value) -> Any:
                outs = list(rule.call_wrapped(*fill_dynamic(args, dynamic, arrays)))
                passed[:] = outs
                return [o for o in outs if is_value(o)]

            closed = jc.trace(flat, [jc.aval_of(args[i]) for i in dynamic])
            n, nin = len(dynamic), len(held)
            in_held: list[int] = [Hold.NONE] * n  # a backward rule: residuals, cotangents
            if n == 2 * nin:  # a jvp rule: primals, then tangents
                in_held = held * 2
            elif n == nin:  # a forward rule: primals
                in_held = held

            def evaluate(*arrays: jc.Value) -> list[jc.Value]:
                outs, _, _ = eval_jaxpr(
                    ctx.replace(in_rule=True),
                    closed.jaxpr,
                    list(closed.consts),
                    list(arrays),
                    mode,
                    inputs=[ValueFacts(static=False, held=h) for h in in_held],
                )
                return to_traced(outs, closed.out_avals)

            # traced, so that its float32 islands become remat regions
            tangents = tangents_inside() if n == 2 * nin else contextlib.nullcontext()
            with tangents:
                rebuilt = trace_body(evaluate, list(closed.in_avals))
            values = iter(jc.jaxpr_as_fun(rebuilt)(*[args[i] for i in dynamic]))
            return [next(values) if is_value(o) else o for o in passed]

        return jc.wrap_fun(rule, run)

    return wrap


def _bind_with_operands(
    ctx: Context,
    eqn: jc.JaxprEqn,
    invals: list[jc.Value],
    mode: Mode,
    body_facts: BodyFacts,
    tb: jc.Traceback | None,
    extra: Extra,
) -> list[jc.Value]:
    """Binds a scan, remat or cond whose rebuilt bodies also take the operands `extra` gives:
    (consts, xs, enter). `consts` join a scan's constants (at the end of a remat's or a
    cond's operands, each branch entered in turn), `xs` (leading axis: the length; scan only)
    its scanned inputs, and `enter(consts, rows)`, given their values inside the body,
    returns a context manager held while the body is evaluated. mpjax.fp8 passes amax sinks
    into bodies this way: one row per iteration, so that scan's transpose stacks their
    cotangents, not sums. The rule of `eqn`'s primitive in _WITH_OPERANDS binds it."""
    consts, xs, enter = extra
    if xs and not interpret.SCAN.of(eqn):
        raise ValueError("only a scan takes extra scanned operands")
    args = to_traced(invals, [v.aval for v in eqn.invars])
    evaluator = functools.partial(
        _body_evaluator, ctx, mode=mode, body_facts=body_facts, traceback=tb
    )
    outs: list[jc.Value] = _WITH_OPERANDS(eqn)(eqn, args, evaluator, consts, xs, enter)
    return outs


# What mpjax.fp8 passes into a body (see _bind_with_operands): (consts, xs, enter), where
# enter(consts, rows) is held while the body is evaluated.
Enter = Callable[[list[jc.Value], list[jc.Value]], contextlib.AbstractContextManager[None]]
Extra = tuple[list[jc.Value], list[jc.Value], Enter]

# A body's evaluator: given a closed jaxpr, evaluates it under the policy (_body_evaluator).
_Evaluator = Callable[[jc.ClosedJaxpr], Callable[[list[jc.Value]], list[jc.Value]]]

# How a primitive's rebuilt bodies take extra operands (see _bind_with_operands), one rule
# per primitive: (eqn, its operands, the body evaluator, consts, xs, enter) -> its results.
_WITH_OPERANDS = interpret.Registry()


@_WITH_OPERANDS.register(*interpret.COND.names)
def _cond_with_operands(
    eqn: jc.JaxprEqn,
    args: list[jc.Value],
    evaluator: _Evaluator,
    consts: list[jc.Value],
    xs: list[jc.Value],
    enter: Enter,
) -> list[jc.Value]:
    """Each branch takes the operands (not the index), then `consts`."""
    n = len(eqn.invars)
    const_avals = [jc.aval_of(c) for c in consts]
    rebuilt = []
    for branch in interpret.branches(eqn):
        evaluate = evaluator(branch)

        def run(
            *a: jc.Value, evaluate: Callable[[list[jc.Value]], list[jc.Value]] = evaluate
        ) -> list[jc.Value]:
            with enter(list(a[n - 1 :]), []):
                return evaluate(list(a[: n - 1]))

        rebuilt.append(trace_body(run, [*branch.in_avals, *const_avals]))
    params = {**eqn.params, interpret.COND.body_params(eqn)[0]: tuple(rebuilt)}
    outs: list[jc.Value] = jc.bind(eqn.primitive, args + list(consts), params)
    return outs


@_WITH_OPERANDS.register(*interpret.SCAN.names)
def _scan_with_operands(
    eqn: jc.JaxprEqn,
    args: list[jc.Value],
    evaluator: _Evaluator,
    consts: list[jc.Value],
    xs: list[jc.Value],
    enter: Enter,
) -> list[jc.Value]:
    """`consts` join the scan's constants, `xs` its scanned inputs."""
    nc = len(interpret.scan_parts(eqn, eqn.invars)[0])
    rebuilt = _with_operands(eqn, interpret.SCAN.body(eqn), nc, evaluator, consts, xs, enter)
    nk, nx = len(consts), len(xs)
    p = {**eqn.params, interpret.SCAN.body_params(eqn)[0]: rebuilt, "num_consts": nc + nk}
    if "linear" in p:  # older JAX (0.6) records which operands are linear
        lin = tuple(p["linear"])
        p["linear"] = lin[:nc] + (False,) * nk + lin[nc:] + (False,) * nx
    outs: list[jc.Value] = jc.bind(
        eqn.primitive, args[:nc] + list(consts) + args[nc:] + list(xs), p
    )
    return outs


@_WITH_OPERANDS.register(*interpret.REMAT.names)
def _remat_with_operands(
    eqn: jc.JaxprEqn,
    args: list[jc.Value],
    evaluator: _Evaluator,
    consts: list[jc.Value],
    xs: list[jc.Value],
    enter: Enter,
) -> list[jc.Value]:
    """`consts` follow the remat's operands."""
    n = len(eqn.invars)
    closed = jc.ClosedJaxpr(interpret.REMAT.body(eqn), [])
    rebuilt = _with_operands(eqn, closed, n, evaluator, consts, [], enter)
    if rebuilt.consts:
        raise _CannotRebuild("rebuilt jaxpr captured constants")
    p = {**eqn.params, interpret.REMAT.body_params(eqn)[0]: rebuilt.jaxpr}
    outs: list[jc.Value] = jc.bind(eqn.primitive, args + list(consts), p)
    return outs


def _with_operands(
    eqn: jc.JaxprEqn,
    closed: jc.ClosedJaxpr,
    nc: int,
    evaluator: _Evaluator,
    consts: list[jc.Value],
    xs: list[jc.Value],
    enter: Enter,
) -> jc.ClosedJaxpr:
    """`closed` rebuilt to take `consts` after its first `nc` inputs and one row of each of
    `xs` after its others, entering `enter` around its evaluation."""
    n, nk = len(eqn.invars), len(consts)
    evaluate = evaluator(closed)

    def body(*a: jc.Value) -> list[jc.Value]:
        args_ = list(a)
        with enter(args_[nc : nc + nk], args_[nk + n :]):
            return evaluate(args_[:nc] + args_[nc + nk : nk + n])

    avals = list(closed.in_avals)
    avals[nc:nc] = [jc.aval_of(c) for c in consts]
    avals += [jc.aval_of(x).update(shape=jc.aval_of(x).shape[1:]) for x in xs]
    return trace_body(body, avals)


def _eval_call(
    ctx: Context,
    body: tuple[Any, list[Any]],
    invals: list[jc.Value],
    eqn: jc.JaxprEqn,
    env: Values,
    uses: Uses,
    mode: Mode,
    tb: jc.Traceback | None,
) -> tuple[list[jc.Value], list[int], list[ValueFacts]]:
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
            dataclasses.replace(
                env.handed(v),
                static=s,
                held=env.held_kind(v),
                known=env.known_value(v) if s else None,
                inert=env.is_inert(v),
            )
            for v, s in zip(eqn.invars, static, strict=True)
        ],
        out_flags=tuple(uses.of(v) for v in eqn.outvars),
        traceback=tb,
    )


def _eval_remat(
    ctx: Context,
    eqn: jc.JaxprEqn,
    env: Values,
    uses: Uses,
    mode: Mode,
    tb: jc.Traceback | None,
    invals: list[jc.Value],
) -> Results:
    """A user's remat (``jax.checkpoint``, ``nn.remat``, ``nnx.remat``), evaluated as an
    inlined call is, inside ``jax.checkpoint`` with its own policy: its operands and results
    keep the dtypes autocast gives them (a remat'ed layer of an O2 model takes and returns
    half, as the hand-written half step's, so what the remat saves, its inputs, is half), a
    name the user saved is saved in the dtype it has, and float32 islands inside are remat
    regions of their own."""
    p = eqn.params
    traced_at = [i for i, x in enumerate(invals) if isinstance(x, jax.core.Tracer)]
    learnt: dict[str, Any] = {}

    def body(*d: jc.Value) -> list[jc.Value]:
        vals = list(invals)
        for i, x in zip(traced_at, d, strict=True):
            vals[i] = x
        outs, holds, handed = _eval_call(ctx, (p["jaxpr"], []), vals, eqn, env, uses, mode, tb)
        learnt["holds"] = holds
        # Twins and island values made inside stay inside the remat's trace.
        learnt["handed"] = [ValueFacts(index=h.index, carried=h.carried) for h in handed]
        return outs

    closed = trace_body(body, [jc.aval_of(invals[i]) for i in traced_at])
    remat = jax.checkpoint(
        jc.jaxpr_as_fun(closed), policy=p.get("policy"), prevent_cse=p.get("prevent_cse", True)
    )
    outs = list(remat(*[invals[i] for i in traced_at]))
    env.take_results(eqn, learnt["handed"])
    return outs, learnt["holds"]


# -- the evaluation's rules --------------------------------------------------------------------
#
# Each rule evaluates one equation under the policy: (first_order.Step, operand values) ->
# (result values, held kinds). Calls are inlined; user remats, loops,
# conds, custom-derivative calls and shard_map are rebuilt with autocast bodies; a higher-order
# primitive autocast does not know runs as traced; every other equation follows the
# first-order rules (first_order.py), which these extend. mpjax.fp8 extends these in turn
# (see Context.rules).
RULES = first_order.RULES.extend()


def _unpack(
    step: Step,
) -> tuple[Context, jc.JaxprEqn, Values, Uses, Mode, jc.Traceback | None]:
    """A step's parts, its context autocast's own (first-order rules need only a part of it)."""
    assert isinstance(step.ctx, Context)
    return step.ctx, step.eqn, step.env, step.uses, step.mode, step.tb


@RULES.register(*interpret.CALL.names)
def _inline_rule(step: Step, invals: list[jc.Value]) -> Results:
    ctx, eqn, env, uses, mode, tb = _unpack(step)
    closed = interpret.CALL.body(eqn)
    body = (closed.jaxpr, list(closed.consts))
    outs, holds, handed = _eval_call(ctx, body, invals, eqn, env, uses, mode, tb)
    # What the call's body learnt (an index made inside jnp.clip, the carry updated inside a
    # jitted step) holds for its results here too.
    env.take_results(eqn, handed)
    return outs, holds


@RULES.register(*interpret.REMAT.names)
def _remat_rule(step: Step, invals: list[jc.Value]) -> Results:
    if not step.eqn.params.get("differentiated", True):
        return _eval_remat(*_unpack(step), invals)
    return _rebuild_rule(step, invals)


# Every primitive with bodies autocast rebuilds, a user's remat aside (see _remat_rule).
@RULES.register(*interpret.CUSTOM_JVP.names, *interpret.CUSTOM_VJP.names)
@RULES.register(*interpret.SCAN.names, *interpret.WHILE.names, *interpret.COND.names)
@RULES.register(*interpret.SHARD_MAP.names)
def _rebuild_rule(step: Step, invals: list[jc.Value]) -> Results:
    ctx, eqn, env, uses, mode, tb = _unpack(step)
    layout = interpret.layout_of(eqn)
    assert layout is not None
    try:
        params = dict(eqn.params)
        for key in layout.body_params(eqn):
            # a shard_map's body is traced per shard
            context = jc.shard_map_context(params) if layout is interpret.SHARD_MAP else None
            body_facts = _body_facts(eqn, key, env, uses, ctx, mode)
            params[key] = _rebuild_param(ctx, params[key], mode, body_facts, context, tb)
        held = [env.held_kind(v) for v in eqn.invars]
        wrap = _rule_wrapper(ctx, mode, held) if interpret.is_custom_call(eqn) else None
        args = to_traced(invals, [v.aval for v in eqn.invars])
        out = jc.bind(eqn.primitive, args, params, wrap_rule=wrap)
        return results(eqn, out)
    except _CannotRebuild as e:
        if layout is interpret.REMAT:  # lose the remat, keep the precision
            outs, holds, _ = eval_jaxpr(ctx, eqn.params["jaxpr"], [], invals, mode, traceback=tb)
            return outs, holds
        why = f"autocast could not rebuild its body ({e})"
        _refuse_or_warn(ctx, eqn, why, warn=True)
        return results(eqn, bind_untouched(eqn, invals, NOT_REBUILT))


@RULES.set_higher_order
def _untouched_rule(step: Step, invals: list[jc.Value]) -> Results:
    """A higher-order primitive autocast does not know, or leaves alone by design: as traced."""
    ctx, eqn = _unpack(step)[:2]
    name = eqn.primitive.name
    _refuse_or_warn(ctx, eqn, untouched_reason(name), warn=name not in ops.UNTOUCHED_OPS)
    out = bind_untouched(eqn, invals)
    return results(eqn, out)


def _refuse_or_warn(ctx: Context, eqn: jc.JaxprEqn, why: str, warn: bool) -> None:
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


def bind_with_bodies(step: Step, invals: list[jc.Value], extra: Extra) -> Results | None:
    """A scan, remat or cond whose rebuilt bodies also take the operands `extra` gives (see
    _bind_with_operands; mpjax.fp8's rules pass FP8 scales into bodies this way), or None
    where the bodies cannot be rebuilt (the rules in force then run it as usual)."""
    ctx, eqn, env, uses, mode, tb = _unpack(step)
    layout = interpret.layout_of(eqn)
    assert layout is not None
    body_facts = _body_facts(eqn, layout.body_params(eqn)[0], env, uses, ctx, mode)
    try:
        out = _bind_with_operands(ctx, eqn, invals, mode, body_facts, tb, extra)
    except _CannotRebuild:
        return None
    return list(out), [Hold.NONE] * len(eqn.outvars)
