"""The jaxpr interpreter core: the layouts of higher-order primitives, a registry of rules keyed
by primitive, and the loops that walk a jaxpr.

Every walk mpjax makes over a jaxpr is a set of rules on this module: autocast's use analysis
(backward) and evaluation (forward), compare's float32 shadow and FLOP count, find_nonfinite,
export's use analysis and FP8's site search. As in JAX's own interpreters (checkify, jet), a
loop here knows no primitive by name: it reads each equation's operands, asks a
:class:`Registry` for the equation's rule and writes what the rule returns. What a
higher-order primitive's bodies are, and which of its operands each body takes, is written
once, in the tables and decoders below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from mpjax._src import jax_compat as jc

T = TypeVar("T")
R = TypeVar("R", bound=Callable[..., Any])  # a rule

# -- the layouts of higher-order primitives --------------------------------------------------------
#
# Every higher-order primitive mpjax's interpreters know, once: the names it has had across
# JAX releases, the params that hold its bodies, and (beside it) how its operands split into
# what each body takes. The interpreters register one rule per primitive by its layout
# (``@RULES.register(*interpret.SCAN.names)``) and read its bodies through it, so no walker
# names a higher-order primitive by string. Adding one: a Layout here, in LAYOUTS (the op
# table records its names as higher order), then a rule in each interpreter that should
# enter it; the others run it as an unknown higher-order primitive.


class Layout:
    """One higher-order primitive: its name (and older names) -> the params holding its
    bodies."""

    def __init__(self, params: Mapping[str, tuple[str, ...]]):
        self.params = dict(params)
        self.names = tuple(self.params)

    def of(self, eqn: jc.JaxprEqn) -> bool:
        """Whether `eqn` is this primitive."""
        return eqn.primitive.name in self.params

    def body_params(self, eqn: jc.JaxprEqn) -> tuple[str, ...]:
        """The params of `eqn` that hold its bodies, in order."""
        return self.params[eqn.primitive.name]

    def body(self, eqn: jc.JaxprEqn) -> Any:
        """The body of `eqn`, for a primitive with one."""
        (key,) = self.body_params(eqn)
        return eqn.params[key]


# Plain calls, inlined by every interpreter: the body takes the operands and gives the
# results one to one.
CALL = Layout(
    {"jit": ("jaxpr",), "pjit": ("jaxpr",), "closed_call": ("call_jaxpr",),
     "core_call": ("call_jaxpr",)}
)  # fmt: skip
# Custom-derivative calls: the body is called as a call is; their rules (jvp, fwd, bwd) are
# functions too. custom_vjp_call_jaxpr is JAX 0.6-0.7's name of custom_vjp_call.
CUSTOM_JVP = Layout({"custom_jvp_call": ("call_jaxpr",)})
CUSTOM_VJP = Layout({"custom_vjp_call": ("call_jaxpr",), "custom_vjp_call_jaxpr": ("fun_jaxpr",)})
# A user's remat (jax.checkpoint): a call whose residuals are recomputed.
REMAT = Layout({"remat2": ("jaxpr",), "checkpoint": ("jaxpr",)})
# shard_map: a call per shard.
SHARD_MAP = Layout({"shard_map": ("jaxpr",)})
# scan: operands (consts, carry, xs) map onto its body's inputs, results (carry, ys) onto
# its outputs (see scan_parts).
SCAN = Layout({"scan": ("jaxpr",)})
# while: a condition and a body (see while_parts, while_bodies).
WHILE_CONDITION = "cond_jaxpr"
WHILE = Layout({"while": (WHILE_CONDITION, "body_jaxpr")})
# cond: the branch index, then each branch's operands (see cond_parts, branches).
COND = Layout({"cond": ("branches",)})

_BODIES = (CUSTOM_JVP, CUSTOM_VJP, REMAT, SCAN, WHILE, COND, SHARD_MAP)
LAYOUTS = (CALL, *_BODIES)

# The calls: each body takes the operands and gives the results one to one.
CALLS = (CALL, CUSTOM_JVP, CUSTOM_VJP, REMAT)
# The param of a scatter that holds its combiner (add, mul, min or max of two scalars): a
# jaxpr, but no body; a scatter is a first-order op.
COMBINER_PARAM = "update_jaxpr"


def layout_of(eqn: jc.JaxprEqn) -> Layout | None:
    """The layout of `eqn`'s primitive, or None for one with no known bodies."""
    return next((layout for layout in LAYOUTS if layout.of(eqn)), None)


def is_custom_call(eqn: jc.JaxprEqn) -> bool:
    """Whether `eqn` is a custom-derivative call (custom_jvp or custom_vjp)."""
    return CUSTOM_JVP.of(eqn) or CUSTOM_VJP.of(eqn)


def is_jaxpr(x: object) -> bool:
    return isinstance(x, (jc.Jaxpr, jc.ClosedJaxpr))


def open_jaxpr(j: jc.Jaxpr | jc.ClosedJaxpr) -> tuple[jc.Jaxpr, list[jc.Value]]:
    """(jaxpr, consts) of a closed or open jaxpr."""
    if isinstance(j, jc.ClosedJaxpr):
        return j.jaxpr, list(j.consts)
    return j, []


def call_body(eqn: jc.JaxprEqn) -> Any:
    """The body of a call (a layout in CALLS), or None for any other equation."""
    layout = next((layout for layout in CALLS if layout.of(eqn)), None)
    return None if layout is None else layout.body(eqn)


def bodies(eqn: jc.JaxprEqn) -> list[jc.Jaxpr | jc.ClosedJaxpr]:
    """Every jaxpr among `eqn`'s params (a cond's branches each), a scatter's combiner too."""
    return [
        sub
        for p in eqn.params.values()
        for sub in (p if isinstance(p, tuple) else (p,))
        if is_jaxpr(sub)
    ]


def is_higher_order(eqn: jc.JaxprEqn) -> bool:
    """Whether `eqn` has a body: a jaxpr param (a cond's tuple of branches too) that is not a
    scatter's combiner."""
    return any(
        is_jaxpr(sub)
        for k, p in eqn.params.items()
        if k != COMBINER_PARAM
        for sub in (p if isinstance(p, tuple) else (p,))
    )


def scan_parts(eqn: jc.JaxprEqn, xs: Sequence[T]) -> tuple[list[T], list[T], list[T]]:
    """A scan's operands (or anything laid out as them) as (consts, carry, scanned)."""
    k, nc = eqn.params["num_consts"], eqn.params["num_carry"]
    return list(xs[:k]), list(xs[k : k + nc]), list(xs[k + nc :])


def while_bodies(eqn: jc.JaxprEqn) -> tuple[jc.ClosedJaxpr, jc.ClosedJaxpr]:
    """A while loop's (condition, body), closed jaxprs."""
    condition, body = WHILE.body_params(eqn)
    return eqn.params[condition], eqn.params[body]


def branches(eqn: jc.JaxprEqn) -> tuple[jc.ClosedJaxpr, ...]:
    """A cond's branches, closed jaxprs."""
    return COND.body(eqn)  # type: ignore[no-any-return]


def while_parts(eqn: jc.JaxprEqn, xs: Sequence[T]) -> tuple[list[T], list[T], list[T]]:
    """A while loop's operands (or anything laid out as them) as (cond consts, body consts,
    carry). Its condition takes (cond consts, carry), its body (body consts, carry)."""
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    return list(xs[:cn]), list(xs[cn : cn + bn]), list(xs[cn + bn :])


def cond_parts(eqn: jc.JaxprEqn, xs: Sequence[T]) -> tuple[T, list[T]]:
    """A cond's operands (or anything laid out as them) as (branch index, branch operands)."""
    return xs[0], list(xs[1:])


# -- rules --------------------------------------------------------------------------------------


class Registry:
    """A registry of rules keyed by primitive name, as JAX keeps one per interpreter.

    A rule is looked up by the equation's primitive; a primitive with no rule of its own gets
    `higher_order` if it has bodies (see :func:`is_higher_order`) and that is set, else
    `default`. :meth:`extend` makes a registry that overrides some rules and falls back to
    this one, so that another interpreter (FP8 over autocast) adds rules without touching
    these."""

    def __init__(
        self,
        default: Callable[..., Any] | None = None,
        higher_order: Callable[..., Any] | None = None,
        parent: Registry | None = None,
    ):
        self._rules: dict[str, Callable[..., Any]] = {}
        self._default = default
        self._higher_order = higher_order
        self._parent = parent

    def register(self, *names: str) -> Callable[[R], R]:
        """Registers the decorated function as the rule of each primitive in `names`."""

        def deco(rule: R) -> R:
            for name in names:
                self._rules[name] = rule
            return rule

        return deco

    def set_default(self, rule: R) -> R:
        self._default = rule
        return rule

    def set_higher_order(self, rule: R) -> R:
        self._higher_order = rule
        return rule

    def own(self, name: str) -> Callable[..., Any] | None:
        """The rule registered for `name` here or in a parent (no fallback)."""
        rule = self._rules.get(name)
        if rule is None and self._parent is not None:
            return self._parent.own(name)
        return rule

    def __call__(self, eqn: jc.JaxprEqn) -> Callable[..., Any]:
        """The rule for `eqn`."""
        rule = self.own(eqn.primitive.name)
        if rule is not None:
            return rule
        if is_higher_order(eqn):
            fallback = self._fallback("_higher_order")
            if fallback is not None:
                return fallback
        default = self._fallback("_default")
        if default is None:
            raise KeyError(f"no rule for {eqn.primitive.name}")
        return default

    def _fallback(self, attr: str) -> Callable[..., Any] | None:
        rule: Callable[..., Any] | None = getattr(self, attr)
        if rule is None and self._parent is not None:
            return self._parent._fallback(attr)
        return rule

    def inherited(self, eqn: jc.JaxprEqn) -> Callable[..., Any]:
        """The rule `eqn` gets from the registry this one extends (see :meth:`extend`)."""
        if self._parent is None:
            raise KeyError("a registry that extends none has no inherited rules")
        return self._parent(eqn)

    def extend(self) -> Registry:
        """A registry whose own rules come first, then this one's."""
        return Registry(parent=self)


# -- the loops ----------------------------------------------------------------------------------


class Env(Generic[T]):
    """The values of a jaxpr's variables during a forward walk."""

    def __init__(
        self,
        jaxpr: jc.Jaxpr | None = None,
        consts: Sequence[T] = (),
        args: Sequence[T] = (),
    ):
        self.vals: dict[jc.Atom, T] = {}
        if jaxpr is not None:
            self.vals.update(zip(jaxpr.constvars, consts, strict=True))
            self.vals.update(zip(jaxpr.invars, args, strict=True))

    def read(self, v: jc.Atom) -> T:
        return v.val if isinstance(v, jc.Literal) else self.vals[v]

    def write(self, eqn: jc.JaxprEqn, outs: Sequence[T]) -> None:
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jc.DropVar):
                self.vals[v] = x


class _NoValues:
    """The environment of a walk that computes no values (a count): reads give None."""

    def read(self, v: jc.Atom) -> None:
        return None

    def write(self, eqn: jc.JaxprEqn, outs: object) -> None:
        pass


NO_VALUES = _NoValues()


def forward(jaxpr: jc.Jaxpr, env: Any, step: Callable[[jc.JaxprEqn, list[T]], Any]) -> list[T]:
    """Walks `jaxpr`'s equations in order: ``env.write(eqn, step(eqn, operand values))``;
    returns the values of its outputs. `env` is an :class:`Env` or anything with its
    ``read``/``write``."""
    for eqn in jaxpr.eqns:
        env.write(eqn, step(eqn, [env.read(v) for v in eqn.invars]))
    return [env.read(v) for v in jaxpr.outvars]


def backward(jaxpr: jc.Jaxpr, step: Callable[[jc.JaxprEqn], None]) -> None:
    """Walks `jaxpr`'s equations from the last to the first (for analyses of uses)."""
    for eqn in reversed(jaxpr.eqns):
        step(eqn)


def eqns_within(jaxpr: jc.Jaxpr) -> Iterator[jc.JaxprEqn]:
    """Every equation of `jaxpr` and of the jaxprs nested in it, in order, depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in bodies(eqn):
            yield from eqns_within(open_jaxpr(sub)[0])
