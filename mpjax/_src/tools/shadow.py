"""The float32 shadow of a mixed-precision program: rules on the interpreter core that run it op
by op beside the same program in float32, and the FLOP count."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from mpjax._src import jax_compat as jc
from mpjax._src.dtypes import is_float
from mpjax._src.interpreter import interpret, ops
from mpjax._src.interpreter.ops import Trait
from mpjax._src.interpreter.rules import BIT_WIDTH_OPS
from mpjax._src.interpreter.values import scatter_update
from mpjax._src.tools.audit_report import short_source
from mpjax._src.tools.compare_metric import relative_error
from mpjax._src.tools.nonfinite import nonfinite_kind

# Ops that only move data: their error is their input's, so they get no row.
NO_OWN_ERROR = ops.having(Trait.MOVES | Trait.PASSES)


# -- the shadow evaluation ---------------------------------------------------------------------


def to_f32(x: Any) -> Any:
    """`x` in float32 where it is a narrower float (the shadow program's values)."""
    if is_float(x) and np.dtype(x.dtype).itemsize < 4:
        return jnp.asarray(x, np.float32)
    return x


def _as_traced(x: Any, v: Any) -> Any:
    """`x` in the dtype the equation's operand `v` has in the mixed program."""
    if isinstance(v, jc.Literal):
        return v.val
    dtype = v.aval.dtype
    if is_float(x) and jnp.issubdtype(dtype, jnp.floating) and x.dtype != dtype:
        return jnp.asarray(x, dtype)
    return x


def _listify(out: Any, eqn: Any) -> list[Any]:
    return list(out) if eqn.primitive.multiple_results else [out]


def _f32_params(eqn: Any) -> dict[str, Any]:
    """The equation's parameters for float32 operands: a half result dtype becomes float32."""
    p = eqn.params
    new: dict[str, Any] = {}
    for k in ("new_dtype", "preferred_element_type", "dtype"):
        v = p.get(k)
        if v is not None and jnp.issubdtype(v, jnp.floating) and np.dtype(v).itemsize < 4:
            new[k] = np.dtype(np.float32)
    if p.get("update_jaxpr") is not None:
        new.update(scatter_update(p, np.dtype(np.float32)))
    return {**p, **new} if new else p


def eqn_flops(eqn: Any) -> int:
    """FLOPs of one dot_general or convolution (0 for other ops)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
        rhs_free = math.prod(d for i, d in enumerate(rhs) if i not in (*rc, *rb))
        return 2 * math.prod(lhs) * rhs_free
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_feature = eqn.params["dimension_numbers"].rhs_spec[0]
        return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs) // max(rhs[out_feature], 1)
    return 0


def dtype_text(eqn: Any) -> str:
    ins = sorted({np.dtype(v.aval.dtype).name for v in eqn.invars if is_float(v.aval)}, key=len)
    outs = [np.dtype(v.aval.dtype).name for v in eqn.outvars if is_float(v.aval)]
    out = outs[0] if outs else "?"
    if not ins or ins == [out]:
        return out
    return f"{'/'.join(ins)}->{out}"


@dataclasses.dataclass
class Stat:
    index: int
    eqn: Any
    name: str
    local: float = 0.0
    error: float = 0.0
    runs: int = 0
    nonfinite: str | None = None


Pair = tuple[Any, Any]  # (value in the mixed program, value in the float32 shadow)


class Shadow:
    """Evaluates a mixed-precision jaxpr eagerly, op by op, on two tracks: as it is (half) and
    with every float in float32 (ref, the float32 program: a cast to half is a no-op there).
    For each op with a floating result it also runs the op as the mixed program does on the
    float32 track's inputs (local). Loop bodies run iteration by iteration."""

    def __init__(self, metric: str | Callable[..., Any]):
        self.metric = metric
        self.stats: dict[tuple[Any, ...], Stat] = {}
        self.first_nonfinite: tuple[Any, ...] | None = None
        self.notes: dict[str, None] = {}  # ordered set

    def run(
        self,
        jaxpr: Any,
        consts: list[Pair],
        args: list[Pair],
        stack: str,
        prefix: tuple[Any, ...],
        tracks: tuple[bool, bool] = (True, True),
    ) -> list[Pair]:
        def step(eqn: Any, ins: list[Pair]) -> list[Pair]:
            own = str(eqn.source_info.name_stack)
            name = f"{stack}/{own}" if stack and own else stack or own
            with eqn.ctx.manager:
                return _SHADOW(eqn)(self, eqn, ins, name, (*prefix, id(eqn)), tracks)

        return interpret.forward(jaxpr, _PairEnv(jaxpr, consts, args), step)

    def _sub(self, closed: Any) -> tuple[Any, list[Pair]]:
        if isinstance(closed, jc.ClosedJaxpr):
            return closed.jaxpr, [(c, to_f32(c)) for c in closed.consts]
        return closed, []

    def _call(
        self, eqn: Any, ins: list[Pair], name: str, key: tuple[Any, ...], tracks: tuple[bool, bool]
    ) -> list[Pair]:
        jaxpr, consts = self._sub(interpret.call_body(eqn))
        return self.run(jaxpr, consts, ins, name, key, tracks)

    def _primitive(
        self, eqn: Any, ins: list[Pair], name: str, key: tuple[Any, ...], tracks: tuple[bool, bool]
    ) -> list[Pair]:
        prim = eqn.primitive.name
        hs = [h for h, _ in ins]
        rs = [r for _, r in ins]
        n = len(eqn.outvars)
        oh = _listify(jc.bind(eqn.primitive, hs, eqn.params), eqn) if tracks[0] else [None] * n
        if not tracks[1]:
            return list(zip(oh, [None] * n, strict=True))
        if eqn.effects and tracks[0]:  # a callback or print runs once
            return [(h, to_f32(h)) for h in oh]
        ref = self._ref(eqn, rs)
        if tracks[0] and prim not in NO_OWN_ERROR and any(is_float(v.aval) for v in eqn.outvars):
            local = _listify(
                jc.bind(
                    eqn.primitive, [_as_traced(r, v) for r, v in zip(rs, eqn.invars)], eqn.params
                ),
                eqn,
            )
            self._record(eqn, key, name, hs, oh, ref, local)
        return list(zip(oh, ref, strict=True))

    def _ref(self, eqn: Any, rs: list[Any]) -> list[Any]:
        """The equation in float32 (the float32 program's op)."""
        prim = eqn.primitive.name
        if prim == "reduce_precision":
            return [rs[0]]
        higher = any(isinstance(p, (jc.Jaxpr, jc.ClosedJaxpr)) for p in eqn.params.values())
        if prim not in BIT_WIDTH_OPS and not (higher and "update_jaxpr" not in eqn.params):
            try:
                return [
                    to_f32(o) for o in _listify(jc.bind(eqn.primitive, rs, _f32_params(eqn)), eqn)
                ]
            except Exception:  # noqa: BLE001 - an op with no float32 form here: as the program
                pass
        self.notes[f"{prim} runs in its own dtypes in the reference, so it shows no error"] = None
        traced = [_as_traced(r, v) for r, v in zip(rs, eqn.invars, strict=True)]
        return [to_f32(o) for o in _listify(jc.bind(eqn.primitive, traced, eqn.params), eqn)]

    def _record(
        self,
        eqn: Any,
        key: tuple[Any, ...],
        name: str,
        hs: list[Any],
        oh: list[Any],
        ref: list[Any],
        local: list[Any],
    ) -> None:
        floats = [
            i
            for i, v in enumerate(eqn.outvars)
            if is_float(v.aval) and not isinstance(v, jc.DropVar)
        ]
        if not floats:
            return
        stat = self.stats.get(key)
        if stat is None:
            stat = self.stats[key] = Stat(len(self.stats), eqn, name)
        stat.runs += 1
        for i in floats:
            h = np.asarray(oh[i], np.float64)
            stat.local = max(stat.local, relative_error(local[i], ref[i], self.metric))
            stat.error = max(stat.error, relative_error(h, ref[i], self.metric))
            kind = nonfinite_kind(h)
            if kind is not None and stat.nonfinite is None:
                made = all(np.isfinite(np.asarray(x, np.float64)).all() for x in hs if is_float(x))
                if made:
                    stat.nonfinite = kind
                    if self.first_nonfinite is None:
                        self.first_nonfinite = key

    def _scan(
        self, eqn: Any, ins: list[Pair], name: str, key: tuple[Any, ...], tracks: tuple[bool, bool]
    ) -> list[Pair]:
        p = eqn.params
        jaxpr, consts = self._sub(p["jaxpr"])
        fixed, carry, xs = interpret.scan_parts(eqn, ins)
        ncarry, length = len(carry), p["length"]
        ys: list[list[Pair]] = []
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for i in steps:
            x_i = [(None if h is None else h[i], None if r is None else r[i]) for h, r in xs]
            out = self.run(jaxpr, consts, [*fixed, *carry, *x_i], name, key, tracks)
            carry = out[:ncarry]
            ys.append(out[ncarry:])
        if p["reverse"]:
            ys.reverse()
        stacked = []
        for j, v in enumerate(eqn.outvars[ncarry:]):
            if length:
                h = jnp.stack([y[j][0] for y in ys]) if tracks[0] else None
                r = jnp.stack([y[j][1] for y in ys]) if tracks[1] else None
            else:
                h = jnp.zeros(v.aval.shape, v.aval.dtype)
                r = to_f32(h)
            stacked.append((h, r))
        return [*carry, *stacked]

    def _while(
        self, eqn: Any, ins: list[Pair], name: str, key: tuple[Any, ...], tracks: tuple[bool, bool]
    ) -> list[Pair]:
        condition, body = interpret.while_bodies(eqn)
        cj, cconsts = self._sub(condition)
        bj, bconsts = self._sub(body)
        cfixed, bfixed, carry = interpret.while_parts(eqn, ins)
        while True:
            (go,) = self.run(
                cj, cconsts, [*cfixed, *carry], name, (*key, interpret.WHILE_CONDITION), tracks
            )
            on = (tracks[0] and bool(go[0]), tracks[1] and bool(go[1]))
            if not any(on):
                return carry
            if on != tracks and all(tracks):
                self.notes[
                    f"a while loop at {short_source(jc.summarize_source(eqn.source_info))} ran a "
                    "different number of iterations than in float32; its body's rows cover "
                    "the iterations both ran"
                ] = None
            out = self.run(bj, bconsts, [*bfixed, *carry], name, key, on)
            carry = [
                (o[0] if on[0] else c[0], o[1] if on[1] else c[1])
                for o, c in zip(out, carry, strict=True)
            ]

    def _cond(
        self, eqn: Any, ins: list[Pair], name: str, key: tuple[Any, ...], tracks: tuple[bool, bool]
    ) -> list[Pair]:
        branches = interpret.branches(eqn)
        last = len(branches) - 1
        which, operands = interpret.cond_parts(eqn, ins)
        index = [min(max(int(x), 0), last) if on else -1 for x, on in zip(which, tracks)]
        if all(tracks) and index[0] == index[1]:
            jaxpr, consts = self._sub(branches[index[0]])
            return self.run(jaxpr, consts, operands, name, (*key, index[0]), tracks)
        if all(tracks):
            self.notes[
                f"a cond at {short_source(jc.summarize_source(eqn.source_info))} took a different "
                "branch than in float32; its branches have no rows there"
            ] = None
        outs: list[list[Any]] = [[None] * len(eqn.outvars), [None] * len(eqn.outvars)]
        for t in (0, 1):
            if tracks[t]:
                jaxpr, consts = self._sub(branches[index[t]])
                single = (t == 0, t == 1)
                res = self.run(jaxpr, consts, operands, name, (*key, index[t]), single)
                outs[t] = [o[t] for o in res]
        return list(zip(outs[0], outs[1], strict=True))


class _PairEnv(interpret.Env[Pair]):
    def read(self, v: Any) -> Pair:
        if isinstance(v, jc.Literal):
            return v.val, to_f32(jc.literal_array(v)) if is_float(v.aval) else v.val
        return self.vals[v]


# The shadow's rules: calls are entered, loops run iteration by iteration, a cond runs the
# branch each track takes; any other equation runs on both tracks (Shadow._primitive).
_SHADOW = interpret.Registry(default=Shadow._primitive)
_SHADOW.register(*(name for call in interpret.CALLS for name in call.names))(Shadow._call)
_SHADOW.register(*interpret.SCAN.names)(Shadow._scan)
_SHADOW.register(*interpret.WHILE.names)(Shadow._while)
_SHADOW.register(*interpret.COND.names)(Shadow._cond)


# The FLOP count's rules: (matmul FLOPs, those with float32 operands) of an equation run
# `times` times. A scan body counts per iteration, a while body once, a cond's costliest
# branch; any other body (a call, a remat) once per run of its equation.
_FLOPS = interpret.Registry()


@_FLOPS.register(*interpret.SCAN.names)
def _scan_flops(eqn: Any, times: int) -> tuple[int, int]:
    return count_flops(
        interpret.open_jaxpr(interpret.SCAN.body(eqn))[0], times * eqn.params["length"]
    )


@_FLOPS.register(*interpret.COND.names)
def _cond_flops(eqn: Any, times: int) -> tuple[int, int]:
    return max(count_flops(b.jaxpr, times) for b in interpret.branches(eqn))


@_FLOPS.set_default
def _eqn_flops_in(eqn: Any, times: int) -> tuple[int, int]:
    total = f32 = 0
    for sub in interpret.bodies(eqn):
        t, f = count_flops(interpret.open_jaxpr(sub)[0], times)
        total, f32 = total + t, f32 + f
    flops = eqn_flops(eqn) * times
    total += flops
    if flops and all(
        np.dtype(v.aval.dtype).itemsize >= 4 for v in eqn.invars[:2] if is_float(v.aval)
    ):
        f32 += flops
    return total, f32


def count_flops(jaxpr: Any, times: int = 1) -> tuple[int, int]:
    """(matmul FLOPs, those with float32 operands) of a jaxpr run `times` times."""
    counts = [(0, 0)]

    def step(eqn: Any, _: Any) -> None:
        counts.append(_FLOPS(eqn)(eqn, times))

    interpret.forward(jaxpr, interpret.NO_VALUES, step)
    return sum(t for t, _ in counts), sum(f for _, f in counts)
