"""Float32 islands as remat regions: float32 values computed from half ones (a norm's
statistics and the elementwise ops around them) are recomputed by the backward pass instead
of kept; a softmax island is differentiated from its half output instead (see _softmax)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mpjax._src import jax_compat as jc
from mpjax._src.dtypes import is_float_dtype
from mpjax._src.interpreter import interpret, ops
from mpjax._src.interpreter.ops import Trait

# Float32 islands (see Values.tag_island): the ops that extend one, the name its values carry,
# and the remat policy that recomputes them for the backward pass instead of keeping them.
ISLAND = "mpjax_float32_island"
ISLAND_OPS = ops.having(Trait.ISLAND)


# Ops an island function's body may hold beside ISLAND_OPS: tests whose boolean results pick
# between float values (jnp.logaddexp's select of its NaN case).
_ISLAND_TESTS = ops.having(Trait.ISLAND_TEST)


def is_island_call(eqn: jc.JaxprEqn) -> bool:
    """Whether `eqn` is a ``custom_jvp`` function whose body holds island ops only
    (`jnp.logaddexp`, and through it `jax.nn.softplus` and `log_sigmoid`): it extends a float32
    island as one op does, its derivative rule kept, so that the island does not end at it
    and keep every float32 value after it for the backward pass."""
    if not interpret.CUSTOM_JVP.of(eqn):
        return False
    body = interpret.CUSTOM_JVP.body(eqn)
    body = getattr(body, "jaxpr", body)
    if body is None:
        return False
    return all(e.primitive.name in ISLAND_OPS or e.primitive.name in _ISLAND_TESTS
               for e in body.eqns)  # fmt: skip


# Ops that make a constant array from literals or constants (see remat_islands).
_CONST_MAKERS = ops.having(Trait.CONSTANT)


# An island's statistics (a norm's per-row mean and mean square): sums whose result is at
# most 1/_STAT_RATIO of what they reduce. The recomputed island keeps them (float32, small)
# instead of reducing again in the backward pass, as a hand-written norm keeps them; the
# rest of the island is recomputed elementwise. A softmax's row sum is not one (see
# _statistics).
STATISTIC = "mpjax_island_statistic"
_STAT_RATIO = 8
_STATISTIC_OPS = ops.having(Trait.STATISTIC)
SAVE_STATISTICS = jax.checkpoint_policies.save_only_these_names(STATISTIC)

# Whether islands rebuilt now may name their statistics. Not inside a jvp rule: its
# tangents are plain values there, but JAX linearizes the rule afterwards, and a statistic of
# tangents (a softmax tangent's ``sum(dz * y)``) is then a linear value whose name JAX cannot
# transpose. Such an island recomputes its statistics instead (see tangents_inside).
_NAMING = [True]


@contextlib.contextmanager
def tangents_inside() -> Iterator[None]:
    """Islands rebuilt within keep no named statistics: the body being rebuilt is a jvp rule,
    whose tangents JAX transposes later (autocast of an autocast program, FP8 over a wrapped
    model)."""
    _NAMING.append(False)
    try:
        yield
    finally:
        _NAMING.pop()


def _named(x: jc.Value, name: str) -> jc.Value:
    """``checkpoint_name(x, name)`` (typed)."""
    named: jc.Value = checkpoint_name(x, name)  # type: ignore[no-untyped-call]
    return named


def as_island(x: jc.Value) -> jc.Value:
    """`x` named as a float32 island's value (see Values.tag_island)."""
    return _named(x, ISLAND)


def _maker(made: dict[jc.Var, jc.JaxprEqn], v: jc.Atom) -> jc.JaxprEqn | None:
    """The equation that makes `v` (None for a literal or an input)."""
    return None if isinstance(v, jc.Literal) else made.get(v)


def _unnamed(made: dict[jc.Var, jc.JaxprEqn], v: jc.Atom) -> jc.Atom:
    """The value `v` names (through ``checkpoint_name`` equations), or `v` itself."""
    while not isinstance(v, jc.Literal) and v in made and made[v].primitive.name == "name":
        v = made[v].invars[0]
    return v


def _statistics(run: list[jc.JaxprEqn]) -> set[jc.Atom]:
    """The results of `run` its recompute keeps (see STATISTIC). The sum of an exp's results
    (through ISLAND names) is a softmax's normalizer: XLA fuses a whole softmax into one
    kernel forward and one backward when it is not kept; kept, the forward takes three."""
    made = {u: e for e in run for u in e.outvars}

    def size(v: jc.Atom) -> int:
        return int(np.prod(jc.aval(v).shape, dtype=np.int64))

    def of_exp(v: jc.Atom) -> bool:
        e = _maker(made, _unnamed(made, v))
        return e is not None and e.primitive.name == "exp"

    return {
        e.outvars[0]
        for e in run
        if e.primitive.name in _STATISTIC_OPS
        and size(e.outvars[0]) * _STAT_RATIO <= size(e.invars[0])
        and not of_exp(e.invars[0])
    }


# Ops a softmax's input may pass through from the region's inputs (a cast up, a mask's fill):
# elementwise and affine in their float operand, so their backward pass needs no primal value
# of that operand, and the cotangent keeps the input's shape and sharding.
_AFFINE = ops.having(Trait.AFFINE)
# The ops between a reduction and the broadcast of its result back.
_REBROADCAST = ops.having(Trait.REBROADCAST)


class _Softmax(NamedTuple):
    z: jc.Var  # the scores the exp reads
    axes: tuple[int, ...]  # the softmax's axes
    differentiable: list[jc.Var]  # the region's inputs z is affine in
    prefix: list[jc.JaxprEqn]  # the equations computing z from them


def _softmax(run: list[jc.JaxprEqn], ins: list[jc.Var], outs: list[jc.Var]) -> _Softmax | None:
    """The softmax a region computes, if it is one (see _Softmax), where the
    region's one output is a half cast of ``exp(z - m) / sum(exp(z - m), axes)`` with `m`
    constant along `axes` (a row max), and `z` is affine in the region's float inputs (a cast
    up, a mask). Else None. Such a region's derivative is ``y * (g - sum(g * y, axes))`` from
    its half output ``y``, which the next gemm keeps anyway: no float32 copy, no recompute."""
    if len(outs) != 1:
        return None
    made = {u: e for e in run for u in e.outvars}
    scores = _softmax_scores(made, outs[0])
    if scores is None:
        return None
    z, axes = scores
    affine = _affine_prefix(made, run, ins, z)
    if affine is None:
        return None
    differentiable, prefix = affine
    return _Softmax(z, axes, differentiable, prefix)


def _softmax_scores(
    made: dict[jc.Var, jc.JaxprEqn], out: jc.Var
) -> tuple[jc.Var, tuple[int, ...]] | None:
    """(z, axes) where `out` is a half cast of ``exp(z - m) / sum(exp(z - m), axes)`` with
    `m` constant along `axes`, else None."""

    def src(v: jc.Atom) -> jc.Atom:
        return _unnamed(made, v)

    def eqn(v: jc.Atom, name: str) -> jc.JaxprEqn | None:
        e = _maker(made, src(v))
        return e if e is not None and e.primitive.name == name else None

    cast = made.get(out)
    if cast is None or not _is_half_cast(cast, up=False):
        return None
    div = eqn(cast.invars[0], "div")
    if div is None:
        return None
    ex = eqn(div.invars[0], "exp")
    den = src(div.invars[1])
    while (
        not isinstance(den, jc.Literal) and den in made and made[den].primitive.name in _REBROADCAST
    ):
        den = src(made[den].invars[0])
    total = made.get(den) if not isinstance(den, jc.Literal) else None
    if ex is None or total is None or total.primitive.name != "reduce_sum":
        return None
    if src(total.invars[0]) != ex.outvars[0]:
        return None
    axes = tuple(total.params["axes"])
    shape = jc.aval(ex.outvars[0]).shape
    kept = tuple(d for i, d in enumerate(shape) if i not in axes)
    if tuple(jc.aval(total.outvars[0]).shape) != kept or not _along(made, div.invars[1], axes):
        return None
    sub = eqn(ex.invars[0], "sub")
    if sub is None or not _along(made, sub.invars[1], axes):
        return None
    z = src(sub.invars[0])
    if isinstance(z, jc.Literal) or tuple(jc.aval(z).shape) != tuple(shape):
        return None
    return z, axes


def _affine_prefix(
    made: dict[jc.Var, jc.JaxprEqn], run: list[jc.JaxprEqn], ins: list[jc.Var], z: jc.Var
) -> tuple[list[jc.Var], list[jc.JaxprEqn]] | None:
    """(the region's inputs `z` is affine in, the equations computing `z` from them), where
    each op on the way is affine, at most one of its operands carrying them (a select's
    predicate and fill do not); else None."""
    carries: dict[jc.Atom, bool] = {v: is_float_dtype(jc.aval(v).dtype) for v in ins}
    for e in run:
        got = [not isinstance(u, jc.Literal) and carries.get(u, False) for u in e.invars]
        for u in e.outvars:
            carries[u] = any(got)
    prefix = _ancestors(made, z)
    for e in prefix:
        got = [not isinstance(u, jc.Literal) and carries.get(u, False) for u in e.invars]
        if not any(got):
            continue
        name = e.primitive.name
        if name not in _AFFINE and not (name == "mul" and sum(got) == 1):
            return None
        if name == "select_n" and got[0]:
            return None
        if name != "select_n" and sum(got) > 1:
            return None
    differentiable = [v for v in ins if carries.get(v) and v in _reads(prefix, z)]
    if any(tuple(jc.aval(v).shape) != tuple(jc.aval(z).shape) for v in differentiable):
        return None
    return differentiable, prefix


def _ancestors(made: dict[jc.Var, jc.JaxprEqn], v: jc.Atom) -> list[jc.JaxprEqn]:
    """The equations `v` is computed from, in order."""
    seen: set[int] = set()
    todo: list[jc.Atom] = [v]
    while todo:
        u = todo.pop()
        e = made.get(u) if not isinstance(u, jc.Literal) else None
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            todo += e.invars
    return [e for e in dict.fromkeys(made.values()) if id(e) in seen]


def _reads(eqns: list[jc.JaxprEqn], z: jc.Var) -> set[jc.Atom]:
    """The values `eqns` read, and `z` itself (a region input taken as it is)."""
    reads: set[jc.Atom] = {u for e in eqns for u in e.invars if not isinstance(u, jc.Literal)}
    return reads | {z}


def _along(made: dict[jc.Var, jc.JaxprEqn], v: jc.Atom, axes: tuple[int, ...]) -> bool:
    """Whether `v` is constant along `axes`: a broadcast along them, through moves that keep
    them (reshapes inserting unit axes, names, stop_gradient)."""
    e = made.get(v) if not isinstance(v, jc.Literal) else None
    while e is not None and e.primitive.name in ("name", "stop_gradient"):
        first = e.invars[0]
        e = made.get(first) if not isinstance(first, jc.Literal) else None
    if e is None or e.primitive.name != "broadcast_in_dim":
        return False
    in_shape = jc.aval(e.invars[0]).shape
    dims = tuple(e.params["broadcast_dimensions"])
    for a in axes:
        if a in dims and in_shape[dims.index(a)] != 1:
            return False
    return True


def _is_half_cast(eqn: jc.JaxprEqn, up: bool) -> bool:
    """Whether `eqn` casts a half value to float32 (`up`), or float32 to a half."""
    if eqn.primitive.name != "convert_element_type" or isinstance(eqn.invars[0], jc.Literal):
        return False
    src, dst = np.dtype(jc.aval(eqn.invars[0]).dtype), np.dtype(eqn.params["new_dtype"])
    if up:
        src, dst = dst, src
    return is_float_dtype(src) and is_float_dtype(dst) and src == np.float32 and dst.itemsize == 2


def remat_islands(closed: jc.ClosedJaxpr, context: Any = None) -> jc.ClosedJaxpr:
    """`closed` with each run of float32-island equations (see Values.tag_island: the ops whose
    results are named ISLAND, and those names) under ``jax.checkpoint`` that saves only the
    island's statistics (see STATISTIC): the backward pass recomputes the rest of the island
    from the half values it started from instead of keeping its float32 values. Forward
    values are unchanged; the names are dropped. `closed` itself if it has no island."""
    eqns = closed.jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    marked = _marked(eqns, producer)
    if not marked or closed.effects:
        return closed
    plan = _plan(eqns, marked)
    regions = _regions(closed, plan, producer)
    # The same island in every layer of a model (a norm, a softmax) is one function: JAX
    # traces a checkpointed function once per input types and caches its derivatives by
    # jaxpr, so differentiating a program pays for each distinct island once, not per layer
    # (docs/guides/internals.md has the trace time this saves).
    functions: dict[Any, Callable[..., list[jc.Value]]] = {}

    def region_function(pos: int) -> tuple[Callable[..., list[jc.Value]], Any]:
        run, ins, outs = regions[pos]
        # The region runs under its ops' common name stack (the island's module), and each op
        # under its own name within it. The casts at its borders that autocast made for the
        # next op (a Dense's bfloat16 input) run under the island's name, so that the same
        # island before different modules is still one function.
        own = [e for e in run if not (_is_half_cast(e, up=True) or _is_half_cast(e, up=False))]
        prefix = jc.common_name_stack([e.source_info.name_stack for e in own or run])
        stacks = [jc.relative_name_stack(e.source_info.name_stack, prefix) for e in run]
        key = _region_key(run, ins, outs, stacks)
        fn = functions.get(key) if key is not None else None
        if fn is None:
            fn = _remat_region(run, ins, outs, stacks)
            if key is not None:
                functions[key] = fn
        return fn, prefix

    def evaluate(*args: jc.Value) -> list[jc.Value]:
        env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(closed.jaxpr.invars, args, strict=True))
        for pos, step in enumerate(plan):
            if pos not in regions:
                _bind(eqns[step], env)
                continue
            run, ins, outs = regions[pos]
            fn, prefix = region_function(pos)
            stack = jc.current_name_stack() + prefix
            with jc.user_context(run[0].source_info.traceback, name_stack=stack):
                env.update(zip(outs, fn(*[env[v] for v in ins]), strict=True))
        return [v.val if isinstance(v, jc.Literal) else env[v] for v in closed.jaxpr.outvars]

    traced: jc.ClosedJaxpr = jc.trace(evaluate, [v.aval for v in closed.jaxpr.invars], context)
    return traced


def _marked(eqns: list[jc.JaxprEqn], producer: dict[jc.Atom, int]) -> set[int]:
    """The positions of the island's equations: those whose results are named ISLAND (and
    the names), the casts up of half values autocast made for them, and the casts down where
    the island ends."""
    marked: set[int] = set()
    for i, e in enumerate(eqns):
        if _is_island_name(e):
            marked.add(i)
            u = e.invars[0]
            if not isinstance(u, jc.Literal) and u in producer:
                marked.add(producer[u])
    for i in sorted(marked):  # and the casts up of half values autocast made for them
        for u in eqns[i].invars:
            k = producer.get(u) if not isinstance(u, jc.Literal) else None
            if k is not None and _is_half_cast(eqns[k], up=True):
                marked.add(k)
    for i, e in enumerate(eqns):  # and the casts down where the island ends
        first = e.invars[0] if e.invars else None
        if first is not None and _is_half_cast(e, up=False) and producer.get(first, -1) in marked:
            marked.add(i)
    return marked


def _plan(eqns: list[jc.JaxprEqn], marked: set[int]) -> list[int | list[int]]:
    """The equations in order, each alone (its position) or in a region (a list). A region
    takes marked equations; an unmarked one between them that reads none of the region's
    values (a reshape of a norm's scale) moves before it, one that does (a running average of
    a batch statistic) moves after it, unless a later marked one reads it: the region ends
    there. So one island is one region."""
    plan: list[int | list[int]] = []
    i = 0
    while i < len(eqns):
        if i not in marked:
            plan.append(i)
            i += 1
            continue
        region: list[int] = []
        before: list[int] = []
        after: list[int] = []
        pending: list[int] = []
        defined: set[jc.Atom] = set()  # the region's values
        later: set[jc.Atom] = set()  # values of equations that move after it
        k = i
        while k < len(eqns):
            e = eqns[k]
            reads = {v for v in e.invars if not isinstance(v, jc.Literal)}
            if k in marked:
                if reads & later:
                    break
                region.append(k)
                defined.update(e.outvars)
                before += [j for j in pending if j not in after]
                pending = []
            else:
                pending.append(k)
                if reads & (defined | later):
                    after.append(k)
                    later.update(e.outvars)
            k += 1
        done = set(region) | set(before)
        plan += before
        plan.append(region)
        plan += [j for j in range(i, k) if j not in done]
        i = k
    return plan


def _regions(
    closed: jc.ClosedJaxpr, plan: list[int | list[int]], producer: dict[jc.Atom, int]
) -> dict[int, tuple[list[jc.JaxprEqn], list[jc.Var], list[jc.Var]]]:
    """Each region's equations (the constants it makes again first), inputs and outputs, by
    its position in `plan`."""
    eqns = closed.jaxpr.eqns
    # Constants made in the program (a mask's fill broadcast to the scores' shape): a region
    # that reads one makes it again inside, so that it is not kept as a residual.
    consts = set(closed.jaxpr.constvars)
    made: set[int] = set()
    for i, e in enumerate(eqns):
        if e.primitive.name in _CONST_MAKERS and all(
            isinstance(v, jc.Literal) or v in consts or producer.get(v) in made for v in e.invars
        ):
            made.add(i)
    last_use: dict[jc.Atom, int] = {}  # by position in the plan
    for pos, step in enumerate(plan):
        for k in step if isinstance(step, list) else [step]:
            for v in eqns[k].invars:
                if not isinstance(v, jc.Literal):
                    last_use[v] = pos
    for v in closed.jaxpr.outvars:
        if not isinstance(v, jc.Literal):
            last_use[v] = len(plan)
    regions: dict[int, tuple[list[jc.JaxprEqn], list[jc.Var], list[jc.Var]]] = {}
    for pos, step in enumerate(plan):
        if not isinstance(step, list):
            continue
        makers: set[int] = set()
        todo = [u for k in step for u in eqns[k].invars]
        while todo:
            u = todo.pop()
            maker = producer.get(u) if not isinstance(u, jc.Literal) else None
            if maker in made and maker not in makers and maker not in step:
                makers.add(maker)
                todo += eqns[maker].invars
        run = [eqns[k] for k in sorted(makers)] + [eqns[k] for k in step]
        defined = {v for e in run for v in e.outvars}
        ins = list(
            dict.fromkeys(
                v
                for e in run
                for v in e.invars
                if not isinstance(v, jc.Literal) and v not in defined
            )
        )
        outs = [v for k in step for v in eqns[k].outvars if last_use.get(v, -1) > pos]
        regions[pos] = (_reductions_fed_last(run, outs), ins, outs)
    return regions


def _reductions_fed_last(run: list[jc.JaxprEqn], outs: list[jc.Var]) -> list[jc.JaxprEqn]:
    """`run` with each op whose one use (through ISLAND names) is a sum (a STATISTIC op)
    moved to just before that sum: the same ops on the same values, in another valid order.

    XLA's GPU fusion pairs a norm's backward reductions by the order it meets them. Flax's
    BatchNorm squares its input before it sums it. In that order, sm_100 pairs the backward
    pass's three per-channel sums so that the ReLU's select before them is written out: one
    activation more per layer than the hand-written ``dtype=`` step, 1.025x its modeled time
    on a BatchNorm CNN. With the square next to its sum, O2's program is the hand-written
    step's, kernel for kernel, on sm_90 and sm_100."""
    uses: dict[jc.Var, list[int]] = {}
    for k, e in enumerate(run):
        for v in e.invars:
            if not isinstance(v, jc.Literal):
                uses.setdefault(v, []).append(k)
    kept = set(outs)
    before: dict[int, int] = {}  # a moved equation's position -> its reduction's
    for i, e in enumerate(run):
        if _is_island_name(e) or len(e.outvars) != 1:
            continue
        chain, v = [i], e.outvars[0]
        while v not in kept and len(uses.get(v, [])) == 1:
            (k,) = uses[v]
            if _is_island_name(run[k]):
                chain.append(k)
                v = run[k].outvars[0]
                continue
            if run[k].primitive.name in _STATISTIC_OPS and k > chain[-1] + 1:
                before.update(dict.fromkeys(chain, k))
            break
    movers: dict[int, list[int]] = {}
    for i in sorted(before):
        movers.setdefault(before[i], []).append(i)
    order: list[jc.JaxprEqn] = []

    def emit(k: int) -> None:  # `k`, after what moves before it (which may have its own)
        for i in movers.get(k, []):
            emit(i)
        order.append(run[k])

    for k in range(len(run)):
        if k not in before:
            emit(k)
    return order


def _is_island_name(eqn: jc.JaxprEqn) -> bool:
    return eqn.primitive.name == "name" and eqn.params.get("name") == ISLAND


def _bind(eqn: jc.JaxprEqn, env: dict[jc.Atom, jc.Value], name_stack: Any = None) -> None:
    """Binds `eqn` on the values of `env` under its own name stack (or `name_stack`), into
    `env`; an ISLAND name passes its value through (the names are dropped)."""
    vals = [v.val if isinstance(v, jc.Literal) else env[v] for v in eqn.invars]
    if _is_island_name(eqn):
        env[eqn.outvars[0]] = vals[0]
        return
    own = eqn.source_info.name_stack if name_stack is None else name_stack
    stack = jc.current_name_stack() + own
    with jc.user_context(eqn.source_info.traceback, name_stack=stack), eqn.ctx.manager:
        out = jc.bind(eqn.primitive, vals, eqn.params)
    outs = out if eqn.primitive.multiple_results else [out]
    env.update(zip(eqn.outvars, outs, strict=True))


def _remat_region(
    run: list[jc.JaxprEqn], ins: list[jc.Var], outs: list[jc.Var], stacks: list[Any]
) -> Callable[..., list[jc.Value]]:
    """The function of a region's inputs that computes its outputs, recomputed by the
    backward pass but for its statistics (a softmax: see _softmax_region)."""
    kept = _statistics(run) if _NAMING[-1] else set()

    def f(*vals: jc.Value) -> list[jc.Value]:
        env: dict[jc.Atom, jc.Value] = dict(zip(ins, vals, strict=True))
        for eqn, stack in zip(run, stacks, strict=True):
            _bind(eqn, env, stack)
            if eqn.outvars and eqn.outvars[0] in kept:
                env[eqn.outvars[0]] = _named(env[eqn.outvars[0]], STATISTIC)
        return [env[v] for v in outs]

    soft = _softmax(run, ins, outs)
    if soft is not None:
        return _softmax_region(f, run, ins, stacks, soft)
    # No optimization barrier on the recompute's inputs (prevent_cse): one would make XLA
    # write the cotangent entering the island (a float32 [N, H, W, C] for a BatchNorm after a
    # ReLU) instead of fusing it into the island's backward reductions.
    return jax.checkpoint(f, policy=SAVE_STATISTICS, prevent_cse=False)


def _softmax_region(
    f: Callable[..., list[jc.Value]],
    run: list[jc.JaxprEqn],
    ins: list[jc.Var],
    stacks: list[Any],
    soft: _Softmax,
) -> Callable[..., list[jc.Value]]:
    """`f`, a softmax region (see _softmax), differentiated by the softmax's own rule, as the
    hand-written half softmax is (jax.nn.softmax's), instead of through the float32 island's
    ops: ``dy = y * (dz - sum(dz * y))`` in float32, with ``dz`` the tangent of `z` through
    the affine ops from the inputs (a cast up, a mask). A ``custom_jvp``, so forward mode
    works too; its tangent is linear, so JAX transposes it for reverse mode, keeping the half
    scores and no float32 value (see _softmax_tangent)."""
    z, axes, diff, prefix = soft
    stack_of = {id(e): st for e, st in zip(run, stacks, strict=True)}
    reads = _reads(prefix, z)
    at = [ins.index(v) for v in diff]
    kept = [i for i, v in enumerate(ins) if v in reads and i not in at]

    def to_z(diff_vals: Sequence[jc.Value], kept_vals: Sequence[jc.Value]) -> jc.Value:
        env: dict[jc.Atom, jc.Value] = dict(zip([ins[i] for i in at], diff_vals, strict=True))
        env.update(zip([ins[i] for i in kept], kept_vals, strict=True))
        for e in prefix:
            _bind(e, env, stack_of[id(e)])
        return env[z]

    @jax.custom_jvp
    def region(*vals: jc.Value) -> list[jc.Value]:
        out: list[jc.Value] = f(*vals)
        return out

    def region_jvp(
        primals: list[jc.Value], tangents: list[jc.Value]
    ) -> tuple[list[jc.Value], list[jc.Value]]:
        out = f(*primals)
        scores = ([primals[i] for i in at], [primals[i] for i in kept])
        dy = _softmax_tangent(to_z, scores, out[0], [tangents[i] for i in at], axes)
        return out, [dy]

    region.defjvp(region_jvp)
    return region


def _softmax_tangent(
    to_z: Callable[[Sequence[jc.Value], Sequence[jc.Value]], jc.Value],
    scores: tuple[list[jc.Value], list[jc.Value]],
    y_half: jc.Value,
    d_in: list[jc.Value],
    axes: tuple[int, ...],
) -> jc.Value:
    """The tangent of a softmax region's half output `y_half` for the tangents `d_in` of its
    inputs: ``y * (dz - sum(dz * y, axes))`` in float32, cast to `y_half`'s dtype, where
    ``dz`` is the scores' tangent through `to_z` (affine: taken at zeros) and ``y`` the
    softmax in float32. Linear in `d_in`, and inside a remat: reverse mode keeps half values
    only, the half output (which the next gemm keeps anyway) or the half scores (`scores`:
    the region's inputs `to_z` reads).

    Where ``y`` comes from is the target's choice, made when the program is lowered, as the
    hand-written half softmax's backward pass is fused on each:

    - a GPU (CUDA, ROCm) makes ``y`` again from the half scores, in the kernel that
      differentiates it: XLA fuses a softmax's backward pass into one Triton kernel only
      where it recomputes the softmax (``y * (g - sum(g * y))`` from a kept ``y`` is a
      reduction and a second pass on sm_90 and sm_100 alike). The row maximum is written
      ``-min(-z)``: XLA would merge the forward's own ``max(z)`` with it, and the backward
      pass then reads the forward's float32 ``exp``, which sm_100's softmax fusions write out
      whole (4.9x the hand-written step's temp memory). A barrier to keep them apart costs a
      pass: on the scores it writes their masked copy, on the maximum it adds a reduction.
    - any other target (a TPU, the CPU) takes ``y`` from the half output: a TPU writes out
      what it cannot fuse, and recomputing moves 1.4x the hand-written step's bytes there.
    """

    def from_scores(
        y_half: jc.Value, diff: Sequence[jc.Value], kept: Sequence[jc.Value]
    ) -> jc.Value:
        z = to_z(diff, kept).astype(np.float32)
        e = jnp.exp(z + jnp.min(-z, axis=axes, keepdims=True))
        y: jc.Value = e / jnp.sum(e, axis=axes, keepdims=True)
        return y

    def from_output(
        y_half: jc.Value, diff: Sequence[jc.Value], kept: Sequence[jc.Value]
    ) -> jc.Value:
        return y_half.astype(np.float32)

    def tangent(
        y_half: jc.Value, diff: Sequence[jc.Value], kept: Sequence[jc.Value], d_in: list[jc.Value]
    ) -> jc.Value:
        zeros = [jnp.zeros_like(d) for d in d_in]
        _, dz = jax.jvp(lambda *d: to_z(d, kept), tuple(zeros), tuple(d_in))
        y: jc.Value = lax.platform_dependent(
            y_half, diff, kept, cuda=from_scores, rocm=from_scores, default=from_output
        )
        t: jc.Value = dz.astype(np.float32)
        return (y * (t - jnp.sum(t * y, axis=axes, keepdims=True))).astype(y_half.dtype)

    nothing = jax.checkpoint_policies.nothing_saveable
    diff, kept = scores
    out: jc.Value = jax.checkpoint(tangent, policy=nothing, prevent_cse=False)(
        y_half, diff, kept, d_in
    )
    return out


def _region_key(
    run: list[jc.JaxprEqn], ins: list[jc.Var], outs: list[jc.Var], stacks: list[Any]
) -> Any:
    """What a region computes, up to its variables' names: equal keys bind the same ops with
    the same params, types, contexts and relative name stacks on the same dataflow. None when
    a param cannot be hashed (the region is then its own function). A context is compared by
    its fields (older JAX compares JaxprEqnContext by identity)."""
    local: dict[Any, Any] = {v: ("in", i) for i, v in enumerate(ins)}

    def ref(v: jc.Atom) -> Any:
        if isinstance(v, jc.Literal):
            val = np.asarray(v.val)
            return ("lit", v.aval, val.dtype.str, val.tobytes())
        return local[v]

    parts = []
    for eqn, stack in zip(run, stacks, strict=True):
        params = tuple(sorted(eqn.params.items()))
        reads = tuple(ref(v) for v in eqn.invars)
        for v in eqn.outvars:
            local[v] = ("v", len(local))
        parts.append(
            (
                eqn.primitive,
                params,
                reads,
                tuple(v.aval for v in eqn.outvars),
                repr(eqn.ctx),
                str(stack),
            )
        )
    key = (tuple(v.aval for v in ins), tuple(parts), tuple(local[v] for v in outs))
    try:
        hash(key)
    except TypeError:
        return None
    return key
