"""What autocast knows of each value while it evaluates a jaxpr (`Values`): the values, which
are constants, held in float32, indices, loop carries, params, half twins, island members, and
the casts it made; and `cast`, its one convert."""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from mpjax._src import jax_compat as jc
from mpjax._src import ops
from mpjax._src.dtypes import dtype_max, is_float_dtype
from mpjax._src.half_grads import gather_half
from mpjax._src.islands import ISLAND_OPS, as_island, is_island_call
from mpjax._src.ops import Trait
from mpjax._src.rules import SHAPE_OPS, Hold, beyond, n_elements

# Known values (trace-time constants) are computed up to this many elements, to check casts.
KNOWN_LIMIT = 1 << 16


def cast(x: Any, dtype: np.dtype, weak_type: bool = False, saturate: bool = False) -> Any:
    """One convert, as ``x.astype(dtype)``: a value that overflows `dtype` becomes inf, as in
    hand-written code and every peer, so loss scaling and find_nonfinite see it. `saturate`
    clamps finite values to `dtype`'s range first; only for values with no derivative path
    (see Values._saturate), where the clamp costs no residual."""
    if getattr(x, "dtype", None) == dtype and not weak_type:
        return x
    if SHADOW_CACHE.get() and not isinstance(x, jax.core.Tracer):
        # See for_shadow: a constant cast down stays a convert of its float32 value.
        x = lax.optimization_barrier(x)  # type: ignore[no-untyped-call]
    if (
        saturate
        and is_float_dtype(dtype)
        and is_float_dtype(x.dtype)
        and dtype_max(dtype) < dtype_max(x.dtype)
    ):
        x = _saturate(x, dtype)
    return jc.convert(x, np.dtype(dtype), weak_type)


def _saturate(x: Any, dtype: np.dtype) -> Any:
    """Clamps finite values to `dtype`'s range, so that a mask fill of finfo(float32).min
    stays finite (-inf - -inf would make NaN where float32 had a number). Infinities and NaN
    pass as they are. XLA fuses this into the convert."""
    lim = lax.full_like(x, dtype_max(dtype))
    clamped = lax.max(lax.min(x, lim), lax.neg(lim))
    return lax.select(lax.eq(lax.abs(x), lax.full_like(x, np.inf)), x, clamped)


class Marks(NamedTuple):
    """Facts of a value that cross an inlined call's boundary: it is an index (a decision or
    made from one), a loop's carry, its half twins by dtype (see Values.twins), whether it
    belongs to a float32 island (see Values.island), and whether it is a param (see
    Values.is_param; None where the caller does not say: an input of the body is taken as one).
    """

    is_index: bool
    is_carried: bool
    twins: dict[np.dtype, Any]
    in_island: bool = False
    is_param: bool | None = None


class InputFacts(NamedTuple):
    """What a caller knows of one input of a jaxpr it evaluates (see autocast.eval_jaxpr)."""

    static: bool | None = None  # computed without float inputs; None: unless it is a float
    held: int = Hold.NONE  # whether, and why, it is held in float32
    known: Any = None  # its value when known at trace time and small
    inert: bool | None = None  # no derivative flows through it; None: where it is static
    marks: Marks | None = None  # its marks (see Marks), where the caller has them


class Values:
    """Per-jaxpr evaluation state: values, and what is known about each."""

    def __init__(self) -> None:
        self.vals: dict[Any, Any] = {}
        self.held: dict[Any, int] = {}  # values held in float32, by Hold kind
        self.static: set[Any] = set()
        self.known: dict[Any, np.ndarray] = {}
        self.index: set[Any] = set()  # decided values and floats made from integers
        # A loop body's carries, and those values updated by CARRY_OPS or moved by shape ops
        # (rules.CARRY_OPS run in the carry's dtype).
        self.carried: set[Any] = set()
        # The value each float was moved from by shape ops (yx[:, 0] sliced twice, once for
        # floor and once for p - floor(p), is one coordinate): facts about uses hold there.
        self.origin: dict[Any, Any] = {}
        # Floats with no derivative path: every float they are computed from is a literal, a
        # trace-time constant or inert itself (a mask bias made from an integer or boolean
        # mask). Only these saturate when cast down: a clamp of a differentiated value would
        # save its masks for the backward pass.
        self.inert: set[Any] = set()
        self.lowered: set[Any] = set()  # results of lower-list ops (matmuls, convolutions)
        self.spread: set[Any] = set()  # results of a broadcast that grows a value (JAX 0.6)
        self.args: set[Any] = set()  # the jaxpr's inputs: params, where gradients end
        # one convert per value and dtype, not per use
        self.casts: dict[tuple[Any, np.dtype, tuple[int, ...]], Any] = {}
        # Half twins of moved float32 values: the same gather, slice or reshape applied to the
        # value's half cast (see Values.move). A consumer that casts the moved value to that
        # half takes the twin, so the movement, and the collective a partitioner puts on it,
        # moves half bytes, as `.astype` before `jnp.take` does; the unused one is dead code.
        self.twins: dict[tuple[Any, np.dtype], Any] = {}
        # Float32 islands: float32 values computed, by elementwise ops, reductions and moves,
        # from half values (a softmax's exp and sums, a loss's log_softmax, a norm's
        # statistics), each named ISLAND (see tag_island). The backward pass recomputes them
        # from the half values they came from instead of keeping them in float32.
        self.island: set[Any] = set()

    def read(self, v: Any) -> Any:
        return v.val if isinstance(v, jc.Literal) else self.vals[v]

    def write(self, eqn: Any, result: tuple[list[Any], list[int]]) -> None:
        """Records an equation's results and what is known of them: held kinds, statics and
        their values, inert, carried and moved values."""
        outvals, holds = result
        static = [self.is_static(v) for v in eqn.invars]
        known = None
        if all(static):
            known = known_outputs(eqn, [self.known_value(v) for v in eqn.invars])
        inert = all(self.is_inert(v) for v in eqn.invars if is_float_dtype(v.aval.dtype))
        carried = eqn.primitive.name in CARRY_PASS and any(
            self.is_carried(v) for v in eqn.invars if is_float_dtype(v.aval.dtype)
        )
        moved = eqn.primitive.name in SHAPE_OPS and not isinstance(eqn.invars[0], jc.Literal)
        for i, (v, x) in enumerate(zip(eqn.outvars, outvals, strict=True)):
            if isinstance(v, jc.DropVar):
                continue
            self.vals[v] = x
            if inert:
                self.inert.add(v)
            if carried and is_float_dtype(v.aval.dtype):
                self.carried.add(v)
            if moved and is_float_dtype(v.aval.dtype) and i == 0:
                self.origin[v] = self.source(eqn.invars[0])
            if holds[i]:
                self.held[v] = holds[i]
            if all(static):
                self.static.add(v)
                if known is not None:
                    self.known[v] = known[i]

    def operand_facts(self, eqn: Any) -> tuple[list[bool], list[int], list[bool]]:
        """Whether each operand of `eqn` is static, its held kind, and whether it is carried."""
        static = [self.is_static(v) for v in eqn.invars]
        held = [self.held_kind(v) for v in eqn.invars]
        carried = [self.is_carried(v) for v in eqn.invars]
        return static, held, carried

    def is_static(self, v: Any) -> bool:
        return isinstance(v, jc.Literal) or v in self.static

    def known_value(self, v: Any) -> Any:
        return jc.literal_array(v) if isinstance(v, jc.Literal) else self.known.get(v)

    def cast(
        self,
        v: Any,
        x: Any,
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
            return cast(jc.literal_array(v), dtype, saturate=self._saturate(v, dtype))
        wide = wide_sums and x.ndim == len(shape) and x.shape != shape
        wide = wide and np.dtype(dtype).itemsize < 4
        twin = self.twins.get((v, np.dtype(dtype)))
        if twin is not None and not wide:
            x = twin  # the same values, moved in half (see move)
        if x.dtype == dtype and not wide:
            return x
        key = (v, np.dtype(dtype), shape)
        if key not in self.casts:
            if wide:
                # A half value goes up and back down for it (at O1/O2): XLA fuses the
                # converts, and no float32 copy is made.
                if x.dtype == dtype:
                    x = jc.convert(x, np.float32)
                x = lax.broadcast_in_dim(x, shape, tuple(range(x.ndim)), out_sharding=sharding)
            self.casts[key] = cast(x, dtype, saturate=self._saturate(v, dtype))
        return self.casts[key]

    def move(self, eqn: Any, invals: list[Any], half: np.dtype, wide_grads: bool) -> None:
        """Makes the half twin of a data movement's result (see `twins`): the op applied to
        its operand's twin, or to the operand's half cast, where the operand is a float32
        value that is no constant and no statistic.

        A movement whose transpose sums (a broadcast that grows a value, a gather that takes
        one row many times) then sums the gradient in half, as the hand-written step's does
        and as the policy's `reduce_dtype` says by default. With `wide_grads` (float32
        reduction asked for), growing broadcasts get no twin and a gather's twin transposes
        to a float32 scatter-add."""
        v, x = eqn.invars[0], invals[0]
        out = eqn.outvars[0]
        if isinstance(v, jc.Literal) or isinstance(out, jc.DropVar):
            return
        name = eqn.primitive.name
        if wide_grads and name == "broadcast_in_dim" and n_elements(out) > n_elements(v):
            return
        src = self.twins.get((v, half))
        plain = v not in self.static and not self.held_kind(v) and v not in self.carried
        if not (plain and getattr(x, "dtype", None) == np.float32):
            if src is None or name == "gather":  # only a twin moves on, and not by a gather
                return
        if wide_grads and name == "gather":
            # It gathers half bytes but transposes as the float32 gather did: the rows an
            # embedding lookup takes many times sum in float32.
            gather = gather_half(eqn.params, half, jc.aval_of(x))
            self.twins[(out, half)] = gather(x, *invals[1:])
            return
        try:
            if src is None:
                src = self.cast(v, x, half, tuple(x.shape))
            self.twins[(out, half)] = jc.bind(eqn.primitive, [src, *invals[1:]], eqn.params)
        except ValueError:
            # A reshard or mesh_cast whose equation runs under another mesh than its
            # operand's type: the cast cannot be made there, so no twin; the cast comes after
            # the movement, as without one.
            return

    def is_bias_add(self, eqn: Any) -> bool:
        """Whether an add adds a smaller, broadcast value (a bias) to a matmul's result."""
        a, b = eqn.invars
        if isinstance(a, jc.Literal) or a not in self.lowered:
            a, b = b, a
        if isinstance(a, jc.Literal) or a not in self.lowered or isinstance(b, jc.Literal):
            return False
        return is_float_dtype(b.aval.dtype) and (n_elements(b) < n_elements(a) or b in self.spread)

    def held_kind(self, v: Any) -> int:
        return 0 if isinstance(v, jc.Literal) else self.held.get(v, 0)

    def marks(self, v: Any) -> Marks:
        """What is known of `v` that an inlined call and its caller hand each other."""
        if isinstance(v, jc.Literal):
            return Marks(False, False, {})
        twins = {d: t for (u, d), t in self.twins.items() if u is v}
        return Marks(v in self.index, v in self.carried, twins, v in self.island, self.is_param(v))

    def mark(self, v: Any, marks: Marks) -> None:
        """Records `marks` (see `marks`) for `v`."""
        if marks.is_index:
            self.index.add(v)
        if marks.is_carried:
            self.carried.add(v)
        for dtype, twin in marks.twins.items():
            self.twins[(v, dtype)] = twin
        if marks.in_island:
            self.island.add(v)

    def mark_results(self, eqn: Any, marks: list[Marks]) -> None:
        """Records what a call's body learnt of its results (see `mark`) for `eqn`'s outputs."""
        for v, m in zip(eqn.outvars, marks, strict=True):
            if not isinstance(v, jc.DropVar):
                self.mark(v, m)

    def is_carried(self, v: Any) -> bool:
        return not isinstance(v, jc.Literal) and v in self.carried

    def tag_island(self, eqn: Any, invals: list[Any], out: Any) -> Any:
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
            if u in self.island or np.dtype(x.dtype).itemsize < 4:
                grows = True
            elif not (self.is_static(u) or self.is_param(u) or n_elements(u) < n_elements(v)):
                return out  # a float32 activation of its own: nothing to recompute from
        if not grows:
            return out
        self.island.add(v)
        return as_island(out)

    def is_param(self, v: Any) -> bool:
        """Whether `v` is an input of the jaxpr, moved by shape ops at most: a param, whose
        gradient the policy's reduce dtype governs (not an activation)."""
        return not isinstance(v, jc.Literal) and self.source(v) in self.args

    def source(self, v: Any) -> Any:
        """The value `v` was moved from by shape ops (itself if none)."""
        return v if isinstance(v, jc.Literal) else self.origin.get(v, v)

    def is_inert(self, v: Any) -> bool:
        return isinstance(v, jc.Literal) or v in self.inert

    def _saturate(self, v: Any, dtype: np.dtype) -> bool:
        """Whether a cast of `v` clamps: only an inert value not known to fit."""
        if not self.is_inert(v):
            return False
        return beyond(self.known_value(v), dtype)

    def saturate_fills(self, eqn: Any, invals: list[Any], half: np.dtype) -> list[Any]:
        """A fill op's known constants beyond `half`'s range, clamped to it in their own dtype:
        at O3 the program runs as if written in half, where jnp.where(mask, x,
        finfo(dtype).min) fills with the half's minimum, even where the where itself runs in
        float32 (its result decides something, as a masked softmax's maximum does)."""
        out = list(invals)
        for i, v in enumerate(eqn.invars):
            known = self.known_value(v)
            if known is None or not is_float_dtype(v.aval.dtype) or not beyond(known, half):
                continue
            lim = dtype_max(half)
            fill = np.where(np.isfinite(known), np.clip(known, -lim, lim), known)
            out[i] = jc.convert(np.asarray(fill, v.aval.dtype), v.aval.dtype, v.aval.weak_type)
        return out


def known_outputs(eqn: Any, known: list[Any]) -> list[Any] | None:
    """The values of an equation on trace-time constants, when small (to check casts)."""
    name = eqn.primitive.name
    if any(k is None for k in known) or not (name in ops.KNOWN_OPS or name in SHAPE_OPS):
        return None
    if any(int(np.prod(v.aval.shape)) > KNOWN_LIMIT for v in eqn.outvars):
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


# The cache that autocast's traces go to ("" outside for_shadow; see for_shadow).
SHADOW_CACHE: contextvars.ContextVar[str] = contextvars.ContextVar("mpjax_shadow", default="")


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


def params_at(eqn: Any, target: Any) -> dict[str, Any]:
    """A matmul's output dtype follows its (cast) operands, unless the program asked for a
    result wider than every operand it traced (``preferred_element_type=jnp.float32`` on half
    operands: half inputs, float32 accumulation and result), which is kept."""
    params: dict[str, Any] = eqn.params
    if params.get("update_jaxpr") is not None and target is not None:
        return {**params, **scatter_update(params, np.dtype(target))}
    pref = params.get("preferred_element_type")
    if pref is None or not is_float_dtype(pref) or target is None:
        return params
    widths = [np.dtype(v.aval.dtype).itemsize for v in eqn.invars if is_float_dtype(v.aval.dtype)]
    if widths and np.dtype(pref).itemsize > max(widths):
        return params
    return {**params, "preferred_element_type": np.dtype(target)}


# -- a call's arguments: arrays (traced) and the rest (static) -------------------------------


def is_value(x: Any) -> bool:
    """Whether a rule's output is a value to trace (not a symbolic zero or None)."""
    return is_dynamic(x) or isinstance(x, (int, float, complex))


def is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def dynamic_leaves(leaves: Any) -> list[int]:
    """The positions of the array leaves; the others are static (baked into the trace)."""
    return [i for i, x in enumerate(leaves) if is_dynamic(x)]


def fill_dynamic(leaves: Any, dynamic: list[int], dyn: Any) -> list[Any]:
    """`leaves` with the dynamic ones replaced by `dyn`."""
    full = list(leaves)
    for i, x in zip(dynamic, dyn, strict=True):
        full[i] = x
    return full
