"""What autocast knows of each value while it evaluates a jaxpr: one `ValueFacts` record per
value (a constant, held in float32, an index, a loop carry, a param, its half twins, an island
member, the casts made of it), kept by `Values` with the values; and `cast`, its one convert."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import lax

from mpjax._src import jax_compat as jc
from mpjax._src.dtypes import dtype_max, is_float_dtype
from mpjax._src.interpreter import ops
from mpjax._src.interpreter.half_grads import gather_half, lookup
from mpjax._src.interpreter.islands import ISLAND_OPS, as_island, is_island_call
from mpjax._src.interpreter.ops import Trait
from mpjax._src.interpreter.rules import MOVE_OPS, Hold, may_exceed, n_elements

# Known values (trace-time constants) are computed up to this many elements, to check casts.
KNOWN_LIMIT = 1 << 16

# A rule's results: the result values, and which are held in float32 (Hold kinds).
Results = tuple[list[jc.Value], list[int]]


def cast(
    x: jc.Value | np.ndarray,
    dtype: np.dtype,
    weak_type: bool = False,
    saturate: bool = False,
    keep_constant: bool = False,
) -> Any:
    """One convert, as ``x.astype(dtype)``: a value that overflows `dtype` becomes inf, as in
    hand-written code and every peer, so loss scaling and find_nonfinite see it. `saturate`
    clamps finite values to `dtype`'s range first; only for values with no derivative path
    (see Values._saturate), where the clamp costs no residual. `keep_constant` (for
    mpjax.compare's float32 shadow, see autocast_api.for_shadow): a constant cast down stays a
    convert of its value, instead of folding into a constant of `dtype`."""
    if getattr(x, "dtype", None) == dtype and not weak_type:
        return x
    if keep_constant and not isinstance(x, jax.core.Tracer):
        x = lax.optimization_barrier(x)  # type: ignore[no-untyped-call]
    if (
        saturate
        and is_float_dtype(dtype)
        and is_float_dtype(x.dtype)
        and dtype_max(dtype) < dtype_max(x.dtype)
    ):
        x = _saturate(x, dtype)
    return jc.convert(x, np.dtype(dtype), weak_type)


def _saturate(x: jc.Value | np.ndarray, dtype: np.dtype) -> jc.Value:
    """Clamps finite values to `dtype`'s range, so that a mask fill of finfo(float32).min
    stays finite (-inf - -inf would make NaN where float32 had a number). Infinities and NaN
    pass as they are. XLA fuses this into the convert."""
    lim = lax.full_like(x, dtype_max(dtype))
    clamped = lax.max(lax.min(x, lim), lax.neg(lim))
    return lax.select(lax.eq(lax.abs(x), lax.full_like(x, np.inf)), x, clamped)


@dataclasses.dataclass(slots=True)
class ValueFacts:
    """What autocast knows of one value. `Values` keeps one per value of the jaxpr it
    evaluates; a call hands its body one per input, where None leaves a fact to the input's
    dtype, and gets one back per result (see :meth:`Values.handed`)."""

    static: bool | None = None  # computed without float inputs; None: unless it is a float
    held: int = Hold.NONE  # whether, and why, it is held in float32
    known: np.ndarray | None = None  # its value when known at trace time and small
    inert: bool | None = None  # no derivative flows through it; None: where it is static
    index: bool = False  # a decided value, or a float made from an integer
    # A loop body's carry, or a value a CARRY_OPS update or a move made of one (rules.CARRY_OPS
    # run in the carry's dtype).
    carried: bool = False
    island: bool = False  # a float32 island's value (see Values.tag_island)
    # An input of the program, moved by shape ops at most: a param, whose gradient the policy's
    # reduce dtype governs (not an activation). None, for an input: the caller does not say,
    # and the input is taken as one.
    param: bool | None = None
    # Half twins by dtype: the same gather, slice or reshape applied to the value's half cast
    # (see Values.move). A consumer that casts the moved value to that half takes the twin, so
    # the movement, and the collective a partitioner puts on it, moves half bytes, as `.astype`
    # before `jnp.take` does; the unused one is dead code.
    twins: dict[np.dtype, jc.Value] = dataclasses.field(default_factory=dict)
    # Known within one evaluation only:
    # the value it was moved from by shape ops (yx[:, 0] sliced twice, once for floor and once
    # for p - floor(p), is one coordinate): facts about uses hold there;
    origin: Any = None
    lowered: bool = False  # the result of a lower-list op (a matmul, a convolution)
    spread: bool = False  # the result of a broadcast that grows a value (JAX 0.6)
    # its casts by dtype and shape: one convert per value and dtype, not per use
    casts: dict[tuple[np.dtype, tuple[int, ...]], Any] = dataclasses.field(default_factory=dict)


class Values:
    """Per-jaxpr evaluation state: the values, and what is known of each (`ValueFacts`)."""

    def __init__(self, keep_constants: bool = False) -> None:
        self.vals: dict[jc.Atom, jc.Value] = {}
        self._facts: dict[jc.Atom, ValueFacts] = {}
        self.keep_constants = keep_constants  # see cast's keep_constant

    def facts(self, v: jc.Atom) -> ValueFacts:
        """`v`'s record, made on first use (a literal's is a fresh one: it is static)."""
        if isinstance(v, jc.Literal):
            return ValueFacts(static=True, inert=True, param=False)
        record = self._facts.get(v)
        if record is None:
            record = self._facts[v] = ValueFacts(static=False, inert=False, param=False)
        return record

    def enter(self, v: jc.Atom, x: jc.Value, facts: ValueFacts) -> None:
        """Records `v`, an input of the jaxpr, as `x` with what its caller knows (`facts`)."""
        self.vals[v] = x
        mine = self.facts(v)
        mine.static = (
            facts.static if facts.static is not None else not is_float_dtype(jc.aval(v).dtype)
        )
        mine.held = facts.held
        mine.known = facts.known
        mine.inert = facts.inert if facts.inert is not None else mine.static
        mine.param = facts.param is not False
        mine.index, mine.carried, mine.island = facts.index, facts.carried, facts.island
        mine.twins = dict(facts.twins)

    def handed(self, v: jc.Atom) -> ValueFacts:
        """What is known of `v` that a call and its body hand each other: an index, a carry,
        its twins, island membership, whether it is a param."""
        if isinstance(v, jc.Literal):
            return ValueFacts()
        f = self.facts(v)
        return ValueFacts(
            index=f.index,
            carried=f.carried,
            island=f.island,
            param=self.is_param(v),
            twins=dict(f.twins),
        )

    def mark_results(self, eqn: jc.JaxprEqn, **facts: bool) -> None:
        """Sets `facts` (``index=True``, ...) on each of `eqn`'s results."""
        for v in eqn.outvars:
            if not isinstance(v, jc.DropVar):
                for name, value in facts.items():
                    setattr(self.facts(v), name, value)

    def take(self, v: jc.Atom, handed: ValueFacts) -> None:
        """Records what a call's body learnt of its result (see `handed`) for `v`."""
        f = self.facts(v)
        f.index |= handed.index
        f.carried |= handed.carried
        f.island |= handed.island
        f.twins.update(handed.twins)

    def take_results(self, eqn: jc.JaxprEqn, handed: list[ValueFacts]) -> None:
        """`take` for each of a call's results."""
        for v, h in zip(eqn.outvars, handed, strict=True):
            if not isinstance(v, jc.DropVar):
                self.take(v, h)

    def read(self, v: jc.Atom) -> jc.Value:
        return v.val if isinstance(v, jc.Literal) else self.vals[v]

    def write(self, eqn: jc.JaxprEqn, result: Results) -> None:
        """Records an equation's results and what is known of them: held kinds, statics and
        their values, inert, carried and moved values."""
        outvals, holds = result
        static = all(self.is_static(v) for v in eqn.invars)
        known = None
        if static:
            known = known_outputs(eqn, [self.known_value(v) for v in eqn.invars])
        inert = all(self.is_inert(v) for v in eqn.invars if is_float_dtype(jc.aval(v).dtype))
        carried = eqn.primitive.name in CARRY_PASS and any(
            self.is_carried(v) for v in eqn.invars if is_float_dtype(jc.aval(v).dtype)
        )
        moved = eqn.primitive.name in MOVE_OPS and not isinstance(eqn.invars[0], jc.Literal)
        for i, (v, x) in enumerate(zip(eqn.outvars, outvals, strict=True)):
            if isinstance(v, jc.DropVar):
                continue
            self.vals[v] = x
            f = self.facts(v)
            f.inert = bool(f.inert) or inert
            floating = is_float_dtype(jc.aval(v).dtype)
            f.carried |= carried and floating
            if moved and floating and i == 0:
                f.origin = self.source(eqn.invars[0])
            if holds[i]:
                f.held = holds[i]
            if static:
                f.static = True
                if known is not None:
                    f.known = known[i]

    def is_static(self, v: jc.Atom) -> bool:
        return bool(self.facts(v).static)

    def known_value(self, v: jc.Atom) -> np.ndarray | None:
        return jc.literal_array(v) if isinstance(v, jc.Literal) else self.facts(v).known

    def is_index(self, v: jc.Atom) -> bool:
        return self.facts(v).index

    def cast(
        self,
        v: jc.Atom,
        x: jc.Value,
        dtype: np.dtype,
        shape: tuple[int, ...],
        wide_sums: bool = False,
        sharding: Any = None,
    ) -> Any:
        """`v`'s value `x` cast to `dtype`. Where the op broadcasts it to `shape` (it grows)
        and `wide_sums` (see rules.WideSums), it is broadcast in float32
        first, typed with `sharding`, that of the result it stands for (see
        jax_compat.typed_sharding): the broadcast's transpose, the gradient's sum, then runs in
        float32 (a bias's gradient), not in half."""
        if isinstance(v, jc.Literal):
            return cast(
                jc.literal_array(v),
                dtype,
                saturate=self._saturate(v, dtype),
                keep_constant=self.keep_constants,
            )
        widen = wide_sums and x.ndim == len(shape) and x.shape != shape
        widen = widen and np.dtype(dtype).itemsize < 4
        f = self.facts(v)
        twin = f.twins.get(np.dtype(dtype))
        if twin is not None and not widen:
            x = twin  # the same values, moved in half (see move)
        if x.dtype == dtype and not widen:
            return x
        key = (np.dtype(dtype), shape)
        if key not in f.casts:
            if widen:
                # A half value goes up and back down for it (at O1/O2): XLA fuses the
                # converts, and no float32 copy is made.
                if x.dtype == dtype:
                    x = jc.convert(x, np.float32)
                x = lax.broadcast_in_dim(x, shape, tuple(range(x.ndim)), out_sharding=sharding)
            f.casts[key] = cast(
                x, dtype, saturate=self._saturate(v, dtype), keep_constant=self.keep_constants
            )
        return f.casts[key]

    def move(
        self,
        eqn: jc.JaxprEqn,
        invals: list[jc.Value],
        half: np.dtype,
        wide_grads: bool,
        wide_lookups: bool,
    ) -> None:
        """Makes the half twin of a data movement's result (see ValueFacts.twins): the op
        applied to its operand's twin, or to the operand's half cast, where the operand is a
        float32 value that is no constant and no statistic.

        A movement whose transpose sums (a broadcast that grows a value, a gather that takes
        one row many times) then sums the gradient in half, as the hand-written step's does
        and as the policy's `reduce_dtype` says by default. With `wide_grads` (float32
        reduction asked for), growing broadcasts get no twin and a gather's twin transposes
        to a float32 scatter-add. With `wide_lookups` (see rules.WideSums) a gather's twin
        scatter-adds its cotangent in float32 and rounds it to half once."""
        v, x = eqn.invars[0], invals[0]
        out = eqn.outvars[0]
        if isinstance(v, jc.Literal) or isinstance(out, jc.DropVar):
            return
        name = eqn.primitive.name
        if wide_grads and name == "broadcast_in_dim" and n_elements(out) > n_elements(v):
            return
        f = self.facts(v)
        src = f.twins.get(half)
        plain = not f.static and not f.held and not f.carried
        if not (plain and getattr(x, "dtype", None) == np.float32):
            if src is None or name == "gather":  # only a twin moves on, and not by a gather
                return
        twins = self.facts(out).twins
        if wide_grads and name == "gather":
            # It gathers half bytes but transposes as the float32 gather did: the rows an
            # embedding lookup takes many times sum in float32.
            gather = gather_half(eqn.params, half, jc.aval_of(x))
            twins[half] = gather(x, *invals[1:])
            return
        try:
            if src is None:
                src = self.cast(v, x, half, tuple(x.shape))
            if name == "gather":
                twins[half] = lookup(eqn.params, src, invals[1], wide_lookups)
            else:
                twins[half] = jc.bind(eqn.primitive, [src, *invals[1:]], eqn.params)
        except ValueError:
            # A reshard or mesh_cast whose equation runs under another mesh than its
            # operand's type: the cast cannot be made there, so no twin; the cast comes after
            # the movement, as without one.
            return

    def is_bias_add(self, eqn: jc.JaxprEqn) -> bool:
        """Whether an add adds a smaller, broadcast value (a bias) to a matmul's result."""
        a, b = eqn.invars
        if isinstance(a, jc.Literal) or not self.facts(a).lowered:
            a, b = b, a
        if isinstance(a, jc.Literal) or not self.facts(a).lowered or isinstance(b, jc.Literal):
            return False
        return is_float_dtype(jc.aval(b).dtype) and (
            n_elements(b) < n_elements(a) or self.facts(b).spread
        )

    def held_kind(self, v: jc.Atom) -> int:
        return 0 if isinstance(v, jc.Literal) else self.facts(v).held

    def is_carried(self, v: jc.Atom) -> bool:
        return self.facts(v).carried

    def tag_island(self, eqn: jc.JaxprEqn, invals: list[jc.Value], out: jc.Value) -> jc.Value:
        """`out`, named ISLAND if `eqn` extends a float32 island: a float32 result of an
        elementwise op, a reduction or a move whose float operands are half values (cast up
        for it), island values, params or smaller than the result (a norm's statistics
        broadcast back), one at least a half or island value. In a remat region (see
        remat_islands) the backward pass recomputes it from those operands, so
        what is kept is the half value the island started from: float32 forward values at the
        memory of the half program. Forward values are unchanged."""
        v = eqn.outvars[0]
        if (
            (eqn.primitive.name not in ISLAND_OPS and not is_island_call(eqn))
            or len(eqn.outvars) != 1
            or isinstance(v, jc.DropVar)
            or not isinstance(out, jax.core.Tracer)
            or not is_float_dtype(out.dtype)
            or np.dtype(out.dtype) != np.float32
        ):
            return out
        grows = False
        for u, x in zip(eqn.invars, invals, strict=True):
            if isinstance(u, jc.Literal) or not is_float_dtype(getattr(x, "dtype", np.int32)):
                continue
            if self.facts(u).island or np.dtype(x.dtype).itemsize < 4:
                grows = True
            elif not (self.is_static(u) or self.is_param(u) or n_elements(u) < n_elements(v)):
                return out  # a float32 activation of its own: nothing to recompute from
        if not grows:
            return out
        self.facts(v).island = True
        return as_island(out)

    def is_param(self, v: jc.Atom) -> bool:
        """Whether `v` is an input of the jaxpr, moved by shape ops at most (see
        ValueFacts.param)."""
        return not isinstance(v, jc.Literal) and bool(self.facts(self.source(v)).param)

    def source(self, v: jc.Atom) -> Any:
        """The value `v` was moved from by shape ops (itself if none)."""
        if isinstance(v, jc.Literal):
            return v
        origin = self.facts(v).origin
        return v if origin is None else origin

    def is_inert(self, v: jc.Atom) -> bool:
        return bool(self.facts(v).inert)

    def _saturate(self, v: jc.Atom, dtype: np.dtype) -> bool:
        """Whether a cast of `v` clamps: only an inert value not known to fit."""
        if not self.is_inert(v):
            return False
        return may_exceed(self.known_value(v), dtype)

    def saturate_fills(
        self, eqn: jc.JaxprEqn, invals: list[jc.Value], half: np.dtype
    ) -> list[jc.Value]:
        """A fill op's known constants beyond `half`'s range, clamped to it in their own dtype:
        at O3 the program runs as if written in half, where jnp.where(mask, x,
        finfo(dtype).min) fills with the half's minimum, even where the where itself runs in
        float32 (its result decides something, as a masked softmax's maximum does)."""
        out = list(invals)
        for i, v in enumerate(eqn.invars):
            known = self.known_value(v)
            if known is None or not is_float_dtype(jc.aval(v).dtype) or not may_exceed(known, half):
                continue
            lim = dtype_max(half)
            fill = np.where(np.isfinite(known), np.clip(known, -lim, lim), known)
            out[i] = jc.convert(
                np.asarray(fill, jc.aval(v).dtype), jc.aval(v).dtype, jc.aval(v).weak_type
            )
        return out


def known_outputs(eqn: jc.JaxprEqn, known: list[Any]) -> list[Any] | None:
    """The values of an equation on trace-time constants, when small (to check casts)."""
    name = eqn.primitive.name
    if any(k is None for k in known) or not (name in ops.KNOWN_OPS or name in MOVE_OPS):
        return None
    if any(int(np.prod(jc.aval(v).shape)) > KNOWN_LIMIT for v in eqn.outvars):
        return None
    try:
        with jax.ensure_compile_time_eval():
            out = jc.bind(eqn.primitive, list(known), eqn.params)
        outs = out if eqn.primitive.multiple_results else [out]
        return [np.asarray(o) for o in outs]
    except Exception:  # a primitive that cannot run eagerly here: the value stays unknown
        return None


# Ops whose result is still the loop's carry when an operand is: updates and moves.
CARRY_PASS = ops.having(Trait.CARRIES | Trait.MOVES | Trait.PASSES | Trait.CAST)


# -- an equation's params for operands cast to a new dtype ----------------------------------


def scatter_update(params: dict[str, Any], dtype: np.dtype) -> dict[str, Any]:
    """A scatter's combiner (``update_jaxpr``: add, mul, min or max of two scalars) traced at
    `dtype`, which its lowering requires to match the operands'."""
    closed = jc.ClosedJaxpr(params["update_jaxpr"], list(params.get("update_consts", ())))
    if all(np.dtype(v.aval.dtype) == dtype for v in closed.jaxpr.invars):
        return {}
    scalar = jax.ShapeDtypeStruct((), dtype)  # type: ignore[no-untyped-call]
    rebuilt = jc.trace(jc.jaxpr_as_fun(closed), [jc.aval_of(scalar)] * len(closed.jaxpr.invars))
    return {"update_jaxpr": rebuilt.jaxpr, "update_consts": tuple(rebuilt.consts)}


def params_at(eqn: jc.JaxprEqn, target: Any) -> dict[str, Any]:
    """A matmul's output dtype follows its (cast) operands, unless the program asked for a
    result wider than every operand it traced (``preferred_element_type=jnp.float32`` on half
    operands: half inputs, float32 accumulation and result), which is kept."""
    params: dict[str, Any] = eqn.params
    if params.get("update_jaxpr") is not None and target is not None:
        return {**params, **scatter_update(params, np.dtype(target))}
    pref = params.get("preferred_element_type")
    if pref is None or not is_float_dtype(pref) or target is None:
        return params
    widths = [
        np.dtype(jc.aval(v).dtype).itemsize for v in eqn.invars if is_float_dtype(jc.aval(v).dtype)
    ]
    if widths and np.dtype(pref).itemsize > max(widths):
        return params
    return {**params, "preferred_element_type": np.dtype(target)}


# -- a call's arguments: arrays (traced) and the rest (static) -------------------------------


def is_value(x: object) -> bool:
    """Whether a rule's output is a value to trace (not a symbolic zero or None)."""
    return is_dynamic(x) or isinstance(x, (int, float, complex))


def is_dynamic(x: object) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def dynamic_leaves(leaves: Any) -> list[int]:
    """The positions of the array leaves; the others are static (baked into the trace)."""
    return [i for i, x in enumerate(leaves) if is_dynamic(x)]


def fill_dynamic(leaves: Any, dynamic: list[int], arrays: Any) -> list[jc.Value]:
    """`leaves` with the dynamic ones replaced by `arrays`."""
    full = list(leaves)
    for i, x in zip(dynamic, arrays, strict=True):
        full[i] = x
    return full
