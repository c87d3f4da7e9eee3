"""Autocast's use analysis: a backward walk that marks each value with what it is used for (it
feeds a decision; it feeds only f32-list ops), by rules per primitive on the interpreter
core."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from mpjax._src import jax_compat as jc
from mpjax._src.dtypes import is_float_dtype
from mpjax._src.interpreter import interpret

# the dtype rules; this module is the machinery that applies them
from mpjax._src.interpreter.rules import (
    NO_USE,
    Mode,
    Use,
    use_flags,
)
from mpjax._src.policy import Policy


class UseContext(Protocol):
    """What the use analysis needs of autocast's evaluation context (autocast.Context): a memo
    of its results per sub-jaxpr, and the mode a name stack's region markers select."""

    memo: dict[Any, Any]

    def mode_for(self, inherited: Mode, name_stack: str) -> Mode: ...


class Uses:
    """What each value of one jaxpr is used for (see rules.Use): the values that feed a
    decision, those that feed only f32-list ops, and the uses of the jaxpr's inputs."""

    def __init__(self, decision: set[jc.Atom], f32only: set[jc.Atom], in_flags: tuple[Use, ...]):
        self.decision, self.f32only, self.in_flags = decision, f32only, in_flags

    def of(self, v: jc.Atom) -> Use:
        """`v`'s use (NO_USE for a literal or a dropped result)."""
        if isinstance(v, (jc.Literal, jc.DropVar)):
            return NO_USE
        return Use(v in self.decision, v in self.f32only)


def analyze(ctx: UseContext, jaxpr: jc.Jaxpr, out_flags: tuple[Use, ...], mode: Mode) -> Uses:
    """The uses of `jaxpr`'s values, walking it backward from its outputs' (`out_flags`), under
    `mode`; memoized in `ctx` per jaxpr, outputs' uses and mode."""
    key = (id(jaxpr), out_flags, id(mode) if isinstance(mode, Policy) else mode)
    if key in ctx.memo:
        memo: Uses = ctx.memo[key][1]
        return memo
    decision: set[jc.Atom] = set()
    used: set[jc.Atom] = set()
    not_f32: set[jc.Atom] = set()

    def use(v: jc.Atom, flags: Use) -> None:
        if isinstance(v, jc.Literal):
            return
        used.add(v)
        if flags[0]:
            decision.add(v)
        if not flags[1]:
            not_f32.add(v)

    def flags_of(v: jc.Atom) -> Use:
        if isinstance(v, (jc.Literal, jc.DropVar)) or v not in used:
            return NO_USE
        return Use(v in decision, v not in not_f32)

    for v, f in zip(jaxpr.outvars, out_flags, strict=True):
        use(v, f)

    def step(eqn: jc.JaxprEqn) -> None:
        eqn_mode = ctx.mode_for(mode, str(eqn.source_info.name_stack))
        outs = [v for v in eqn.outvars if not isinstance(v, jc.DropVar)]
        fouts = [v for v in outs if is_float_dtype(jc.aval(v).dtype)]
        out_dec = any(v in decision for v in fouts)
        out_f32 = bool(fouts) and all(v in used and v not in not_f32 for v in fouts)
        flags = USE_RULES(eqn)(ctx, eqn, eqn_mode, out_dec, out_f32, flags_of)
        for v, f in zip(eqn.invars, flags, strict=True):
            use(v, f)

    interpret.backward(jaxpr, step)
    f32only = {v for v in used if v not in not_f32}
    uses = Uses(decision, f32only, tuple(flags_of(v) for v in jaxpr.invars))
    ctx.memo[key] = (jaxpr, uses)  # the jaxpr is kept alive so that its id stays unique
    return uses


# The use analysis's rules: the flags of an equation's operands, given its results' uses (see
# rules.use_flags, the rule of first-order primitives). A call's operands are used as its
# body uses them; a decision inside a scan's or a cond's body is a decision on the operand;
# a while loop's carries that its condition depends on (through any number of iterations)
# decide. Other bodies (remat, shard_map, unknown higher-order primitives) are opaque here.
USE_RULES = interpret.Registry(
    default=lambda ctx, eqn, mode, out_dec, out_f32, flags_of: use_flags(
        eqn, mode, out_dec, out_f32
    )
)


@USE_RULES.set_higher_order
@USE_RULES.register(*interpret.REMAT.names, *interpret.SHARD_MAP.names)
def _opaque_uses(ctx: UseContext, eqn: jc.JaxprEqn, *_: Any) -> list[Use]:
    return [NO_USE] * len(eqn.invars)


@USE_RULES.register(*interpret.CALL.names, *interpret.CUSTOM_JVP.names, *interpret.CUSTOM_VJP.names)
def _call_uses(
    ctx: UseContext,
    eqn: jc.JaxprEqn,
    mode: Mode,
    out_dec: bool,
    out_f32: bool,
    flags_of: Callable[[jc.Atom], Use],
) -> list[Use]:
    out_flags = tuple(flags_of(v) for v in eqn.outvars)
    inner = interpret.call_body(eqn)
    return list(analyze(ctx, inner.jaxpr, out_flags, mode).in_flags)


@USE_RULES.register(*interpret.WHILE.names)
def _while_uses(
    ctx: UseContext,
    eqn: jc.JaxprEqn,
    mode: Mode,
    out_dec: bool,
    out_f32: bool,
    flags_of: Callable[[jc.Atom], Use],
) -> list[Use]:
    cf, bf, decided = while_facts(ctx, eqn, mode)
    cconsts, bconsts, carry = interpret.while_parts(eqn, eqn.invars)
    cn, bn = len(cconsts), len(bconsts)
    return [*cf[:cn], *bf[:bn], *[Use(i in decided, False) for i in range(len(carry))]]


@USE_RULES.register(*interpret.SCAN.names)
def _scan_uses(
    ctx: UseContext,
    eqn: jc.JaxprEqn,
    mode: Mode,
    out_dec: bool,
    out_f32: bool,
    flags_of: Callable[[jc.Atom], Use],
) -> list[Use]:
    body = interpret.SCAN.body(eqn)
    bf = analyze(ctx, body.jaxpr, (NO_USE,) * len(body.jaxpr.outvars), mode).in_flags
    return [Use(f.decides, False) for f in bf]


@USE_RULES.register(*interpret.COND.names)
def _cond_uses(
    ctx: UseContext,
    eqn: jc.JaxprEqn,
    mode: Mode,
    out_dec: bool,
    out_f32: bool,
    flags_of: Callable[[jc.Atom], Use],
) -> list[Use]:
    branch_flags = [
        analyze(ctx, b.jaxpr, (NO_USE,) * len(b.jaxpr.outvars), mode).in_flags
        for b in interpret.branches(eqn)
    ]
    _, operands = interpret.cond_parts(eqn, eqn.invars)
    decides = [any(bf[i].decides for bf in branch_flags) for i in range(len(operands))]
    return [NO_USE] + [Use(d, False) for d in decides]


def while_facts(
    ctx: UseContext, eqn: jc.JaxprEqn, mode: Mode
) -> tuple[tuple[Use, ...], tuple[Use, ...], frozenset[int]]:
    """The carries a while loop's condition depends on (through any number of iterations)."""
    cond, body = interpret.while_bodies(eqn)
    cconsts, bconsts, carry = interpret.while_parts(eqn, eqn.invars)
    cn, bn, ncarry = len(cconsts), len(bconsts), len(carry)
    cf = analyze(ctx, cond.jaxpr, (Use(True, False),), mode).in_flags
    decided = frozenset(i for i in range(ncarry) if cf[cn + i][0])
    while True:
        out_flags = tuple(Use(i in decided, False) for i in range(ncarry))
        bf = analyze(ctx, body.jaxpr, out_flags, mode).in_flags
        grown = decided | {i for i in range(ncarry) if bf[bn + i][0]}
        if grown == decided:
            return cf, bf, decided
        decided = grown
