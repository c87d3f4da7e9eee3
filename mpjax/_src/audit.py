"""What ran in which precision: `audit` reads the lowered StableHLO (and the backend's
optimized HLO) of a function and reports its matmuls, converts and half-precision risks."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpjax._src.autocast import INLINE_CALLS, UNTOUCHED_SCOPE

HALF_TYPES = ("f16", "bf16")
_TYPE_NAMES = {
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
}
# StableHLO ops that the f32 list keeps in float32, by their f32-list name.
_RISK_OPS = {
    "stablehlo.exponential": "exp",
    "stablehlo.exponential_minus_one": "expm1",
    "stablehlo.log": "log",
    "stablehlo.log_plus_one": "log1p",
    "stablehlo.rsqrt": "rsqrt",
    "stablehlo.power": "pow",
    "stablehlo.tan": "tan",
    "chlo.sinh": "sinh",
    "chlo.cosh": "cosh",
    "chlo.asin": "asin",
    "chlo.acos": "acos",
    "chlo.erf_inv": "erf_inv",
}
_TENSOR = re.compile(r"tensor<([^>]*)>")
_LOC_REF = re.compile(r"loc\((#loc\d*)\)\s*$")


def _parse_tensor(text: str) -> tuple[tuple[int, ...], str]:
    """'4x3xbf16' -> ((4, 3), 'bf16'); 'f32' -> ((), 'f32')."""
    parts = text.split("x")
    dims = tuple(int(p) if p.isdigit() else -1 for p in parts[:-1])
    return dims, parts[-1]


def _signature(line: str) -> tuple[list[tuple[tuple[int, ...], str]], list[tuple]]:
    """Operand and result tensor types from the trailing ': (...) -> ...' of an op line."""
    body = _LOC_REF.sub("", line).rstrip()
    if " : " not in body:
        return [], []
    sig = body.rsplit(" : ", 1)[1]
    if "->" in sig:
        ins, outs = sig.split("->", 1)
    else:  # elementwise ops print one type for operands and result
        ins = outs = sig
    return [_parse_tensor(t) for t in _TENSOR.findall(ins)], [
        _parse_tensor(t) for t in _TENSOR.findall(outs)
    ]


class _Locations:
    """Resolves StableHLO '#locN' references to an op name and a source file:line."""

    def __init__(self, text: str):
        self.raw: dict[str, str] = {}
        for line in text.splitlines():
            m = re.match(r"^(#loc\d*) = loc\((.*)\)\s*$", line)
            if m:
                self.raw[m.group(1)] = m.group(2)

    def resolve(self, ref: str, depth: int = 0) -> tuple[str | None, str | None]:
        body = self.raw.get(ref)
        if body is None or depth > 50:
            return None, None
        m = re.match(r'^"([^"]*)":(\d+):', body)
        if m:
            return None, f"{m.group(1)}:{m.group(2)}"
        m = re.match(r"^callsite\((#loc\d*) at (#loc\d*)\)$", body)
        if m:
            name, src = self.resolve(m.group(1), depth + 1)
            if src is None:
                _, src = self.resolve(m.group(2), depth + 1)
            return name, src
        m = re.match(r'^"([^"]*)"\((#loc\d*)\)$', body)
        if m:
            _, src = self.resolve(m.group(2), depth + 1)
            return m.group(1), src
        m = re.match(r'^"([^"]*)"$', body)
        if m:
            return m.group(1), None
        return None, None


@dataclasses.dataclass(frozen=True)
class MatmulOp:
    """One dot_general or convolution of the program."""

    kind: str
    operand_dtypes: tuple[str, ...]
    result_dtype: str
    operand_shapes: tuple[tuple[int, ...], ...]
    result_shape: tuple[int, ...]
    flops: int
    name: str | None
    source: str | None
    aligned: bool

    @property
    def half(self) -> bool:
        """Both operands in float16 or bfloat16."""
        return all(d in ("float16", "bfloat16") for d in self.operand_dtypes)


@dataclasses.dataclass(frozen=True)
class Risk:
    """An op of the float32 list that ran in half precision."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    name: str | None
    source: str | None


@dataclasses.dataclass(frozen=True)
class Collective:
    """A cross-device collective: in the lowered program (explicit, e.g. psum) or inserted
    by the compiler for sharded arrays (stage "compiled")."""

    kind: str
    dtypes: tuple[str, ...]
    stage: str


_STABLEHLO_COLLECTIVES = {
    "stablehlo.all_reduce": "all-reduce",
    "stablehlo.reduce_scatter": "reduce-scatter",
    "stablehlo.all_gather": "all-gather",
    "stablehlo.all_to_all": "all-to-all",
}
_HLO_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s(all-reduce|all-reduce-start|reduce-scatter|"
    r"all-gather|all-gather-start|all-to-all)\("
)


def _dtypes_in(text: str) -> tuple[str, ...]:
    return tuple(_TYPE_NAMES[t] for t in re.findall(r"\b(bf16|f16|f32|f64)\[", text))


def _dot_flops_and_alignment(line: str, ins: list, outs: list) -> tuple[int, bool]:
    (lhs_shape, _), (rhs_shape, _) = ins[0], ins[1]
    contracting = re.search(r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]", line)
    batching = re.search(r"batching_dims = \[([\d, ]*)\] x \[([\d, ]*)\]", line)

    def dims(text: str) -> list[int]:
        return [int(d) for d in text.replace(" ", "").split(",") if d]

    lc = dims(contracting.group(1)) if contracting else []
    rc = dims(contracting.group(2)) if contracting else []
    lb = dims(batching.group(1)) if batching else []
    rb = dims(batching.group(2)) if batching else []
    k = math.prod(lhs_shape[d] for d in lc)
    flops = 2 * math.prod(outs[0][0]) * k
    free = [lhs_shape[d] for d in range(len(lhs_shape)) if d not in lc + lb] + [
        rhs_shape[d] for d in range(len(rhs_shape)) if d not in rc + rb
    ]
    aligned = all(n % 8 == 0 for n in [k, *free] if n > 1)
    return flops, aligned


def _conv_flops_and_alignment(line: str, ins: list, outs: list) -> tuple[int, bool]:
    rhs_shape = ins[1][0]
    m = re.search(r"\]x\[([^\]]*)\]->", line)
    kernel_layout = [d.strip() for d in m.group(1).split(",")] if m else []
    if "o" in kernel_layout and "i" in kernel_layout:
        out_ch = rhs_shape[kernel_layout.index("o")]
        in_ch = rhs_shape[kernel_layout.index("i")]
    else:
        out_ch, in_ch = rhs_shape[-1], rhs_shape[-2]
    flops = 2 * math.prod(outs[0][0]) * (math.prod(rhs_shape) // max(out_ch, 1))
    return flops, in_ch % 8 == 0 and out_ch % 8 == 0


def _lowered_collective(kind: str, line: str) -> Collective:
    """A collective of the lowered program, its operand dtypes read from `line`'s types."""
    ins, _ = _signature(line)
    return Collective(kind, tuple(_TYPE_NAMES.get(t, t) for _, t in ins), "lowered")


def _parse_stablehlo(
    text: str,
) -> tuple[list[MatmulOp], int, list[Risk], list[str], list[Collective]]:
    locs = _Locations(text)
    matmuls: list[MatmulOp] = []
    risks: list[Risk] = []
    untouched: list[str] = []
    collectives: list[Collective] = []
    converts = 0
    pending: str | None = None  # a region op (all_reduce) whose types close its region
    for line in text.splitlines():
        stripped = line.strip()
        if pending and stripped.startswith("})") and " : " in stripped:
            collectives.append(_lowered_collective(pending, stripped))
            pending = None
            continue
        if not stripped.startswith("%") or " = " not in stripped:
            continue
        op = stripped.split(" = ", 1)[1].split(" ", 1)[0].split("(", 1)[0].strip('"')
        ref = _LOC_REF.search(stripped)
        name, source = locs.resolve(ref.group(1)) if ref else (None, None)
        if name and UNTOUCHED_SCOPE in name:
            prim = name.split(UNTOUCHED_SCOPE + ":", 1)[1].split("/", 1)[0]
            if prim not in untouched:
                untouched.append(prim)
        if op == "stablehlo.convert":
            converts += 1
            continue
        if op in _STABLEHLO_COLLECTIVES:
            if stripped.endswith("({"):  # the generic form: types follow the region
                pending = _STABLEHLO_COLLECTIVES[op]
            else:
                collectives.append(_lowered_collective(_STABLEHLO_COLLECTIVES[op], stripped))
            continue
        if op in ("stablehlo.dot_general", "stablehlo.convolution"):
            ins, outs = _signature(stripped)
            if len(ins) < 2 or not outs:
                continue
            if op == "stablehlo.dot_general":
                flops, aligned = _dot_flops_and_alignment(stripped, ins, outs)
            else:
                flops, aligned = _conv_flops_and_alignment(stripped, ins, outs)
            matmuls.append(
                MatmulOp(
                    kind=op.split(".", 1)[1],
                    operand_dtypes=tuple(_TYPE_NAMES.get(t, t) for _, t in ins[:2]),
                    result_dtype=_TYPE_NAMES.get(outs[0][1], outs[0][1]),
                    operand_shapes=tuple(s for s, _ in ins[:2]),
                    result_shape=outs[0][0],
                    flops=flops,
                    name=name,
                    source=source,
                    aligned=aligned,
                )
            )
            continue
        risk_name = _RISK_OPS.get(op)
        if op == "stablehlo.reduce":
            if "applies stablehlo.add" in stripped:
                risk_name = "reduce_sum"
            elif "applies stablehlo.multiply" in stripped:
                risk_name = "reduce_prod"
        if risk_name:
            _, outs = _signature(stripped)
            if outs and outs[0][1] in HALF_TYPES:
                risks.append(Risk(risk_name, _TYPE_NAMES[outs[0][1]], outs[0][0], name, source))
    return matmuls, converts, risks, untouched, collectives


_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[[^=]*?\s([\w\-]+)\((.*)$")
_HLO_MATMUL_TARGET = re.compile(r"gemm|conv|matmul", re.I)


def _parse_compiled(text: str) -> tuple[list[tuple[str, tuple[str, ...]]], list[Collective]]:
    """(kind, operand dtypes) of each dot/convolution/library matmul in optimized HLO, and
    the collectives the compiler inserted."""
    found = []
    collectives = []
    dtypes: dict[str, str] = {}
    for line in text.splitlines():
        c = _HLO_COLLECTIVE.match(line)
        if c:
            collectives.append(
                Collective(c.group(2).replace("-start", ""), _dtypes_in(c.group(1)), "compiled")
            )
        if line.rstrip().endswith("{") and "=" not in line.split("(", 1)[0]:
            dtypes = {}  # a new computation: names are local to it
            continue
        m = _HLO_INSTR.match(line)
        if not m:
            continue
        name, dtype, opcode, rest = m.groups()
        dtypes[name] = dtype
        if opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            if not target or not _HLO_MATMUL_TARGET.search(target.group(1)):
                continue
            opcode = target.group(1)
        elif opcode not in ("dot", "convolution"):
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        found.append(
            (
                opcode,
                tuple(
                    _TYPE_NAMES.get(dtypes.get(o, "?"), dtypes.get(o, "?")) for o in operands[:2]
                ),
            )
        )
    return found, collectives


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What a function runs in which precision. ``str(report)`` is a table.

    Attributes:
      matmuls: every dot_general and convolution of the lowered program.
      converts: the number of dtype conversions.
      risks: float32-list ops (exp, log, rsqrt, sums, ...) that run in half precision.
      untouched: primitives autocast did not know and ran in their traced dtype.
      compiled_matmuls: (kind, operand dtypes) of the matmuls in the backend's optimized HLO,
        or None if it could not be compiled. On CPU, XLA may run half matmuls in float32.
      backend: the backend the program was lowered for.
      collectives: all-reduces, reduce-scatters and all-gathers with their dtypes, explicit
        ("lowered") and compiler-inserted for sharded arrays ("compiled").

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> report = mpjax.audit(lambda a, b: a @ b, jnp.ones((8, 16)), jnp.ones((16, 8)))
      >>> report.total_flops, report.half_flop_share, report.to_dict()["converts"]
      (2048, 0.0, 0)
    """

    matmuls: tuple[MatmulOp, ...]
    converts: int
    risks: tuple[Risk, ...]
    untouched: tuple[str, ...]
    compiled_matmuls: tuple[tuple[str, tuple[str, ...]], ...] | None
    backend: str
    collectives: tuple[Collective, ...] = ()

    @property
    def total_flops(self) -> int:
        """FLOPs of all matmuls and convolutions."""
        return sum(m.flops for m in self.matmuls)

    @property
    def half_flop_share(self) -> float:
        """The share of matmul/conv FLOPs whose operands are half (0.0 with no matmuls)."""
        total = self.total_flops
        return sum(m.flops for m in self.matmuls if m.half) / total if total else 0.0

    @property
    def misaligned(self) -> tuple[MatmulOp, ...]:
        """Half matmuls with a dimension that is not a multiple of 8 (slow on tensor cores)."""
        return tuple(m for m in self.matmuls if m.half and not m.aligned)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the report, for tests and CI."""
        return {
            "backend": self.backend,
            "matmuls": [dataclasses.asdict(m) | {"half": m.half} for m in self.matmuls],
            "total_flops": self.total_flops,
            "half_flop_share": self.half_flop_share,
            "converts": self.converts,
            "risks": [dataclasses.asdict(r) for r in self.risks],
            "untouched": list(self.untouched),
            "misaligned": len(self.misaligned),
            "collectives": [dataclasses.asdict(c) for c in self.collectives],
            "compiled_matmuls": None
            if self.compiled_matmuls is None
            else [{"kind": k, "operand_dtypes": list(d)} for k, d in self.compiled_matmuls],
        }

    def assert_matmuls_in(self, dtype: Any) -> None:
        """Raises AssertionError naming each matmul whose operands are not all `dtype`.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> f = mpjax.autocast(lambda w, x: x @ w, mpjax.Policy.from_level("O2", "bfloat16"))
          >>> mpjax.audit(f, jnp.ones((8, 8)), jnp.ones((8, 8))).assert_matmuls_in(jnp.bfloat16)
        """
        want = np.dtype(dtype).name
        bad = [m for m in self.matmuls if any(d != want for d in m.operand_dtypes)]
        if bad:
            lines = [
                f"  {m.kind} {' x '.join(m.operand_dtypes)} {m.operand_shapes} at "
                f"{m.source or 'unknown source'} ({m.name or 'unnamed'})"
                for m in bad
            ]
            raise AssertionError(
                f"{len(bad)} of {len(self.matmuls)} matmuls are not in {want}:\n" + "\n".join(lines)
            )

    def __str__(self) -> str:
        rows = [
            f"mpjax audit ({self.backend}): {len(self.matmuls)} matmuls, "
            f"{100 * self.half_flop_share:.1f}% of {self.total_flops:,} FLOPs in half, "
            f"{self.converts} converts, {len(self.risks)} f32-list ops in half",
            "",
            "| op | operands | result | shapes | GFLOP | tensor-core aligned | where |",
            "|---|---|---|---|---:|---|---|",
        ]
        for m in self.matmuls:
            shapes = " x ".join("[" + ",".join(map(str, s)) + "]" for s in m.operand_shapes)
            rows.append(
                f"| {m.kind} | {' x '.join(m.operand_dtypes)} | {m.result_dtype} | {shapes} | "
                f"{m.flops / 1e9:.4f} | {'yes' if m.aligned else 'no'} | "
                f"{_short(m.source)} |"
            )
        if self.risks:
            rows += ["", "f32-list ops in half (overflow/accuracy risks):"]
            rows += [f"  {r.op} {r.dtype}{list(r.shape)} at {_short(r.source)}" for r in self.risks]
        if self.misaligned:
            rows += [
                "",
                f"advice: {len(self.misaligned)} half matmul(s) have a dimension that is not a "
                "multiple of 8; pad it for tensor cores.",
            ]
        if self.untouched:
            rows += ["", f"autocast left in their traced dtype: {', '.join(self.untouched)}"]
        if self.collectives:
            rows += ["", "collectives:"]
            rows += [f"  {c.kind} {' '.join(c.dtypes)} ({c.stage})" for c in self.collectives]
        if self.compiled_matmuls is not None:
            kinds = sorted({" x ".join(d) for _, d in self.compiled_matmuls if d})
            rows += ["", f"backend runs matmuls as: {'; '.join(kinds) or 'none found'}"]
        return "\n".join(rows)


def _short(source: str | None) -> str:
    if not source:
        return "?"
    path, _, line = source.rpartition(":")
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def audit(fn: Callable[..., Any], *args: Any, compile: bool = True, **kwargs: Any) -> AuditReport:
    """Reports what `fn` runs in which precision, read from its lowered program.

    Lowers ``fn(*args, **kwargs)`` (jitted or not) to StableHLO and lists every dot_general
    and convolution with operand and result dtypes, shapes, FLOPs and source location; counts
    converts; flags float32-list ops (exp, log, rsqrt, sums, ...) that run in half; and
    advises on half matmuls not aligned to 8 (tensor cores). With `compile`, it also reads the
    backend's optimized HLO to show the dtypes the matmuls really run in.

    Args:
      fn: the function, e.g. a jitted train step.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      compile: also compile and read the optimized HLO (default True).
      **kwargs: its keyword arguments.

    Returns:
      An :class:`AuditReport`.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> policy = mpjax.Policy.from_level("O1", "float16")
      >>> f = mpjax.autocast(lambda w, x: jax.nn.softmax(x @ w), policy)
      >>> report = mpjax.audit(f, jnp.ones((16, 8)), jnp.ones((4, 16)))
      >>> report.half_flop_share, len(report.risks)
      (1.0, 0)
    """
    if not callable(fn):
        raise TypeError(f"audit needs a function, got {type(fn).__name__}.")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    lowered = jitted.lower(*args, **kwargs)
    text = lowered.as_text(debug_info=True)
    matmuls, converts, risks, untouched, collectives = _parse_stablehlo(text)
    compiled = None
    if compile:
        try:
            compiled_matmuls, inserted = _parse_compiled(lowered.compile().as_text())
            compiled = tuple(compiled_matmuls)
            collectives += inserted
        except Exception:  # noqa: BLE001 - the report stands without the optimized HLO
            compiled = None
    return AuditReport(
        matmuls=tuple(matmuls),
        converts=converts,
        risks=tuple(risks),
        untouched=tuple(untouched),
        compiled_matmuls=compiled,
        backend=jax.default_backend(),
        collectives=tuple(collectives),
    )


@dataclasses.dataclass(frozen=True)
class NonFiniteOrigin:
    """The first op of a function that made an inf or nan from finite inputs.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> origin = mpjax.find_nonfinite(lambda x: jnp.sqrt(x - 2.0), jnp.ones(2))
      >>> origin.primitive, origin.kind, origin.shape
      ('sqrt', 'nan', (2,))"""

    primitive: str
    name: str
    source: str | None
    dtype: str
    shape: tuple[int, ...]
    kind: str

    def __str__(self) -> str:
        return (
            f"{self.kind} first produced by {self.primitive} -> {self.dtype}{list(self.shape)} "
            f"in {self.name or '<top level>'} at {self.source or 'unknown source'}"
        )


_CALL_PARAMS = {
    **INLINE_CALLS,
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}


def _first_nonfinite(jaxpr: Any, consts: list, args: list, stack: str) -> Any:
    from jax._src import core as jax_core
    from jax._src import source_info_util

    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jax_core.Literal) else env[v]

    def bad(x: Any) -> str | None:
        if not (hasattr(x, "dtype") and np.issubdtype(np.dtype(x.dtype), np.inexact)):
            return None
        arr = np.asarray(x, np.float64) if np.dtype(x.dtype).itemsize <= 8 else np.asarray(x)
        if np.isnan(arr).any():
            return "nan"
        if np.isinf(arr).any():
            return "inf"
        return None

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = "/".join(p for p in (stack, str(eqn.source_info.name_stack)) if p)
        key = _CALL_PARAMS.get(eqn.primitive.name)
        if key is not None and all(bad(x) is None for x in invals):
            sub = eqn.params[key]
            sub_jaxpr, sub_consts = (
                (sub.jaxpr, list(sub.consts)) if hasattr(sub, "consts") else (sub, [])
            )
            found, outs = _first_nonfinite(sub_jaxpr, sub_consts, invals, name)
            if found is not None:
                return found, None
        else:
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
            kinds = [bad(x) for x in outs]
            if any(kinds) and all(bad(x) is None for x in invals):
                out = outs[[k is not None for k in kinds].index(True)]
                return NonFiniteOrigin(
                    primitive=eqn.primitive.name,
                    name=name,
                    source=source_info_util.summarize(eqn.source_info),
                    dtype=np.dtype(out.dtype).name,
                    shape=tuple(out.shape),
                    kind=next(k for k in kinds if k),
                ), None
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return None, [read(v) for v in jaxpr.outvars]


def find_nonfinite(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NonFiniteOrigin | None:
    """Runs `fn` op by op (eagerly, for debugging) and names the first op that produced an
    inf or nan from finite inputs, with its source line. Returns None if every value is finite.

    For when even O0 diverges: ``mpjax.find_nonfinite(loss_fn, params, batch)``. Wrap `fn` in
    :func:`mpjax.autocast` to debug it under a policy. Arguments must be arrays or pytrees of
    arrays. It recurses into jit, custom_jvp/vjp and remat; loops run whole.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> def f(x):
      ...     return jnp.log(x - 1.0).sum()
      >>> origin = mpjax.find_nonfinite(f, jnp.array([2.0, 1.0]))
      >>> origin.primitive, origin.kind
      ('log', 'inf')
    """
    if not callable(fn):
        raise TypeError(f"find_nonfinite needs a function, got {type(fn).__name__}.")
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    for leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, float, int, bool)):
            raise TypeError(
                f"find_nonfinite takes arrays (or pytrees of arrays), got a {type(leaf).__name__}; "
                "close over other arguments with functools.partial."
            )
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    found, _ = _first_nonfinite(closed.jaxpr, list(closed.consts), leaves, "")
    return found
