"""What ran in which precision: `audit` walks a function's lowered StableHLO module through
the MLIR Python bindings (and reads the backend's optimized HLO text), and reports its
matmuls, converts and half-precision risks."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

from mpjax._src import jax_compat
from mpjax._src.autocast import INLINE_CALLS, UNTOUCHED_SCOPE, _is_dynamic, flat_call

HALF_DTYPES = ("float16", "bfloat16")


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
    # For each operand, the float8 dtype it was dequantized from right before the op (None
    # where it was not): how an FP8 matmul appears in a lowered module (mpjax.fp8, Flax's
    # fp8_ops, TransformerEngine's JAX ops), and the pattern XLA's GPU compiler rewrites into
    # an FP8 GEMM. Empty when neither operand is.
    fp8_dtypes: tuple[str | None, ...] = ()

    @property
    def half(self) -> bool:
        """Both operands in float16 or bfloat16."""
        return all(d in HALF_DTYPES for d in self.operand_dtypes)

    @property
    def fp8(self) -> bool:
        """Both operands in float8, or dequantized from float8 right before the op."""
        return len(self.fp8_dtypes) == 2 and all(d is not None for d in self.fp8_dtypes)


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
    """A cross-device collective: in the lowered program (explicit, e.g. psum, stage
    "lowered"), or placed by the SPMD partitioner for sharded arrays (stage "partitioned",
    with its result's shape and bytes per device), or in the backend's optimized program
    (stage "compiled"; the CPU backend widens bfloat16 collectives to float32 there, so
    dtypes are read from the "partitioned" stage)."""

    kind: str
    dtypes: tuple[str, ...]
    stage: str
    shape: tuple[int, ...] = ()
    bytes: int = 0
    name: str = ""  # the op it came from ("transpose(...)" in it: the backward pass)


# -- the lowered StableHLO module, walked through the MLIR bindings ------------------------

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
# A stablehlo.reduce whose body is one of these ops (and its return) is a sum or a product.
_REDUCTIONS = {"stablehlo.add": "reduce_sum", "stablehlo.multiply": "reduce_prod"}
_MATMULS = {"stablehlo.dot_general": "dot_general", "stablehlo.convolution": "convolution"}
_STABLEHLO_COLLECTIVES = {
    "stablehlo.all_reduce": "all-reduce",
    "stablehlo.reduce_scatter": "reduce-scatter",
    "stablehlo.all_gather": "all-gather",
    "stablehlo.all_to_all": "all-to-all",
}
# Attributes naming the functions an op runs: func.call's callee, a composite's
# decomposition, a custom call's called computations.
_CALLEE_ATTRS = ("callee", "decomposition", "called_computations")
_FLOAT_TYPES = (
    (ir.F16Type, "float16"),
    (ir.BF16Type, "bfloat16"),
    (ir.F32Type, "float32"),
    (ir.F64Type, "float64"),
)


def _dtype(element_type: Any) -> str:
    """The NumPy name of an MLIR element type: 'float16', 'int32', 'bool'."""
    for cls, name in _FLOAT_TYPES:
        if isinstance(element_type, cls):
            return name
    if isinstance(element_type, ir.IntegerType):
        if element_type.width == 1:
            return "bool"
        return f"{'uint' if element_type.is_unsigned else 'int'}{element_type.width}"
    name = str(element_type)
    if name.startswith("f8"):  # f8E4M3FN -> float8_e4m3fn, NumPy's (ml_dtypes') name
        return "float8_" + name[2:].lower()
    return name  # complex, ...: MLIR's name of the type


def _tensor(value: Any) -> tuple[tuple[int, ...], str] | None:
    """(shape, dtype) of a ranked tensor value (-1 for a dynamic dimension), else None."""
    t = value.type
    if not isinstance(t, ir.RankedTensorType):
        return None
    shape = tuple(-1 if t.is_dynamic_dim(i) else d for i, d in enumerate(t.shape))
    return shape, _dtype(t.element_type)


def _location_kind(loc: Any) -> str:
    """'name', 'callsite', 'file', 'fused' or 'other': which kind of MLIR location `loc` is.

    The bindings' way to tell changed with MLIR (llvm-project#192630, April 2026); the two
    branches below are the only version-specific part of the walk.
    """
    if hasattr(loc, "is_a_name"):
        # JAX 0.6.0 up to the releases on MLIR before that change (tested: 0.6.0): one
        # ir.Location class with is_a_* predicates and every kind's accessors.
        for kind in ("name", "callsite", "file", "fused"):
            if getattr(loc, f"is_a_{kind}")():
                return kind
        return "other"
    # Newer JAX (tested: 0.10.2): a subclass per kind (NameLoc, CallSiteLoc, ...), to which a
    # location read from an operation or from another location is already cast.
    for cls, kind in (
        ("NameLoc", "name"),
        ("CallSiteLoc", "callsite"),
        ("FileLineColLoc", "file"),
        ("FusedLoc", "fused"),
    ):
        if isinstance(loc, getattr(ir, cls, ())):
            return kind
    return "other"


def _describe(loc: Any) -> tuple[str | None, str | None]:
    """(name, 'file:line') of an op's location: the outermost name (JAX's name stack, with
    any mpjax_untouched scope) and the innermost source frame (the user's line)."""
    kind = _location_kind(loc)
    if kind == "name":
        _, source = _describe(loc.child_loc)
        return loc.name_str, source
    if kind == "callsite":
        name, source = _describe(loc.callee)
        return name, source or _describe(loc.caller)[1]
    if kind == "file":
        return None, f"{loc.filename}:{loc.start_line}"
    if kind == "fused":
        name = source = None
        for part in loc.locations:
            part_name, part_source = _describe(part)
            name, source = name or part_name, source or part_source
        return name, source
    return None, None


def _symbol(op: Any) -> str | None:
    attrs = op.attributes
    return ir.StringAttr(attrs["sym_name"]).value if "sym_name" in attrs else None


def _callees(op: Any) -> list[str]:
    """The functions that `op` runs (by symbol), from its callee-like attributes."""
    names = []
    attrs = op.attributes
    for key in _CALLEE_ATTRS:
        if key in attrs:
            attr = attrs[key]
            refs = list(attr) if isinstance(attr, ir.ArrayAttr) else [attr]
            names += [r.value for r in refs if isinstance(r, ir.FlatSymbolRefAttr)]
    return names


def _functions(module: Any) -> dict[str, Any]:
    """The module's functions by symbol."""
    return {
        name: op.operation
        for op in module.body.operations
        if op.operation.name == "func.func" and (name := _symbol(op.operation)) is not None
    }


def _operations(module: Any) -> Iterator[tuple[Any, str | None, str | None]]:
    """(operation, name, source) of every operation of `module` in program order, from its
    entry function: the regions of loops, conditionals and collectives in place, and a called
    function's body at each call (so the ops of a function called from two places come
    twice). Functions that no call reaches are read once, at the end.

    An op with no source line of its own (JAX drops its own frames, so the body of a jitted
    library function such as ``jax.nn.softmax`` has none) gets that of the op it runs under:
    the call, loop or reduction that the user's line made.
    """
    funcs = _functions(module)
    reached: set[str] = set()

    def walk(op: Any, active: frozenset[str], outer: str | None) -> Iterator[Any]:
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    name, source = _describe(child.location)
                    source = source or outer
                    yield child, name, source
                    yield from walk(child, active, source)
                    for callee in _callees(child):
                        if callee in funcs and callee not in active:  # no recursion in HLO
                            reached.add(callee)
                            yield from walk(funcs[callee], active | {callee}, source)

    entry = "main" if "main" in funcs else next(iter(funcs), None)
    for name in [entry, *funcs]:
        if name is not None and name not in reached:
            reached.add(name)
            yield from walk(funcs[name], frozenset({name}), None)


def _dot_flops_and_alignment(
    op: Any, lhs: tuple[int, ...], rhs: tuple[int, ...], out: tuple[int, ...]
) -> tuple[int, bool]:
    dims = stablehlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    lc, rc = list(dims.lhs_contracting_dimensions), list(dims.rhs_contracting_dimensions)
    lb, rb = list(dims.lhs_batching_dimensions), list(dims.rhs_batching_dimensions)
    k = math.prod(lhs[d] for d in lc)
    free = [lhs[d] for d in range(len(lhs)) if d not in lc + lb] + [
        rhs[d] for d in range(len(rhs)) if d not in rc + rb
    ]
    return 2 * math.prod(out) * k, all(n % 8 == 0 for n in [k, *free] if n > 1)


def _conv_flops_and_alignment(
    op: Any, lhs: tuple[int, ...], rhs: tuple[int, ...], out: tuple[int, ...]
) -> tuple[int, bool]:
    dims = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    out_ch = rhs[dims.kernel_output_feature_dimension]
    in_ch = rhs[dims.kernel_input_feature_dimension]  # per feature group
    flops = 2 * math.prod(out) * (math.prod(rhs) // max(out_ch, 1))
    return flops, in_ch % 8 == 0 and out_ch % 8 == 0


# Ops that carry a dequantized value to a matmul unchanged but for layout or a scale.
_DEQUANT_PATH = frozenset(
    {
        "stablehlo.multiply",
        "stablehlo.divide",
        "stablehlo.convert",
        "stablehlo.transpose",
        "stablehlo.reshape",
        "stablehlo.broadcast_in_dim",
        "stablehlo.slice",
        "stablehlo.dynamic_slice",
        "stablehlo.optimization_barrier",
    }
)


def _owner(owner: Any) -> Any:
    """The operation of a result's or a use's owner (an OpView or an Operation)."""
    return owner.operation if hasattr(owner, "operation") else owner


def _result(value: Any) -> Any:
    """`value` as the result of an operation, or None for a block argument."""
    try:
        return ir.OpResult(value)
    except ValueError:
        return None


def _fp8_origin(value: Any, funcs: dict[str, Any], depth: int = 12) -> str | None:
    """The float8 dtype `value` holds or was dequantized from (a convert from float8, then
    scales, converts and layout changes), or None. Follows results of called functions and
    of optimization barriers (remat); stops at block arguments (loop carries)."""
    t = _tensor(value)
    if t is not None and t[1].startswith("float8"):
        return t[1]
    if depth == 0:
        return None
    result = _result(value)
    if result is None:
        return None  # a block argument
    op = _owner(result.owner)
    name = op.name
    if name == "func.call":
        callee = next((funcs[c] for c in _callees(op) if c in funcs), None)
        if callee is None:
            return None
        ret = list(callee.regions[0].blocks[0].operations)[-1].operation
        return _fp8_origin(ret.operands[result.result_number], funcs, depth - 1)
    if name == "stablehlo.optimization_barrier":
        return _fp8_origin(op.operands[result.result_number], funcs, depth - 1)
    if name not in _DEQUANT_PATH:
        return None
    operands = list(op.operands)
    if name in ("stablehlo.divide", "stablehlo.dynamic_slice"):
        operands = operands[:1]  # the dividend; the sliced array (not the indices)
    for v in operands:
        found = _fp8_origin(v, funcs, depth - 1)
        if found is not None:
            return found
    return None


def _reduction(op: Any) -> str | None:
    """'reduce_sum' or 'reduce_prod' for a reduce whose body is one add or multiply."""
    body = [o.operation.name for region in op.regions for b in region.blocks for o in b.operations]
    return _REDUCTIONS.get(body[0]) if len(body) == 2 and body[1] == "stablehlo.return" else None


def _sums_one_element(op: Any) -> bool:
    """Whether a reduce has as many results as operand elements (its axes have size 1)."""
    src, out = _tensor(op.operands[0]), _tensor(op.results[0])
    return src is not None and out is not None and math.prod(src[0]) == math.prod(out[0])


def _producer(value: Any) -> Any:
    """The operation that defines `value`, or None for a block argument."""
    result = _result(value)
    return None if result is None else _owner(result.owner)


def _is_constant(value: Any) -> bool:
    op = _producer(value)
    while op is not None and op.name == "stablehlo.broadcast_in_dim":
        op = _producer(op.operands[0])
    return op is not None and op.name == "stablehlo.constant"


def _exp_cannot_overflow(op: Any) -> bool:
    """Whether a half ``exp`` is harmless by construction, so not a risk: its argument is
    ``-(x*x)`` or ``-|x|`` (erf's derivative; its exp is at most 1), or it only feeds
    ``c / (k + exp)`` (JAX's lowering of logistic, so sigmoid and silu), where an overflow
    gives the right limit, 0."""
    arg = _producer(op.operands[0])
    if arg is not None and arg.name == "stablehlo.negate":  # -(x*x), -|x|
        inner = _producer(arg.operands[0])
        if inner is not None and inner.name in ("chlo.square", "stablehlo.abs"):
            return True
        if inner is not None and inner.name == "stablehlo.multiply":
            a, b = inner.operands
            if a == b:
                return True
    if arg is not None and arg.name == "stablehlo.multiply":  # (-x)*x, x*(-x)
        a, b = arg.operands
        for neg, other in ((a, b), (b, a)):
            p = _producer(neg)
            if p is not None and p.name == "stablehlo.negate" and p.operands[0] == other:
                return True
    uses = list(op.results[0].uses)
    if not uses:
        return False
    for use in uses:
        add = _owner(use.owner)
        if add.name != "stablehlo.add" or not any(_is_constant(v) for v in add.operands):
            return False
        for div_use in add.results[0].uses:
            if _owner(div_use.owner).name != "stablehlo.divide" or div_use.operand_number != 1:
                return False
    return True


@dataclasses.dataclass
class _Lowered:
    """What the walk of the lowered module found."""

    matmuls: list[MatmulOp] = dataclasses.field(default_factory=list)
    converts: int = 0
    risks: list[Risk] = dataclasses.field(default_factory=list)
    untouched: list[str] = dataclasses.field(default_factory=list)
    collectives: list[Collective] = dataclasses.field(default_factory=list)


def _read_module(module: Any) -> _Lowered:
    """Walks a lowered StableHLO module (an MLIR ``ir.Module``) through the MLIR bindings:
    op names, operand and result types, attributes and locations, never the module's text."""
    found = _Lowered()
    with module.context:
        funcs = _functions(module)
        for op, name, source in _operations(module):
            kind = op.name
            if name and UNTOUCHED_SCOPE + ":" in name:
                # Under vmap or another transform the scope is wrapped:
                # "vmap(vmap(mpjax_untouched:stack))/...": the name ends at the first ")" or "/".
                prim = re.split(r"[/)]", name.split(UNTOUCHED_SCOPE + ":", 1)[1], maxsplit=1)[0]
                if prim not in found.untouched:
                    found.untouched.append(prim)
            if kind == "stablehlo.convert":
                found.converts += 1
            elif kind in _STABLEHLO_COLLECTIVES:
                dtypes = tuple(t[1] for v in op.operands if (t := _tensor(v)) is not None)
                found.collectives.append(
                    Collective(_STABLEHLO_COLLECTIVES[kind], dtypes, "lowered")
                )
            elif kind in _MATMULS:
                ins = [_tensor(v) for v in list(op.operands)[:2]]
                out = _tensor(op.results[0]) if len(op.results) else None
                if len(ins) < 2 or ins[0] is None or ins[1] is None or out is None:
                    continue
                (lhs, lhs_dtype), (rhs, rhs_dtype) = ins[0], ins[1]
                count = (
                    _dot_flops_and_alignment
                    if kind == "stablehlo.dot_general"
                    else (_conv_flops_and_alignment)
                )
                flops, aligned = count(op, lhs, rhs, out[0])
                fp8 = tuple(_fp8_origin(v, funcs) for v in list(op.operands)[:2])
                found.matmuls.append(
                    MatmulOp(
                        kind=_MATMULS[kind],
                        operand_dtypes=(lhs_dtype, rhs_dtype),
                        result_dtype=out[1],
                        operand_shapes=(lhs, rhs),
                        result_shape=out[0],
                        flops=flops,
                        name=name,
                        source=source,
                        aligned=aligned,
                        fp8_dtypes=fp8 if any(fp8) else (),
                    )
                )
            else:
                risk = _reduction(op) if kind == "stablehlo.reduce" else _RISK_OPS.get(kind)
                if risk == "exp" and _exp_cannot_overflow(op):
                    risk = None
                if kind == "stablehlo.reduce" and risk and _sums_one_element(op):
                    risk = None  # a reduction over size-1 axes adds nothing: exact in any dtype
                out = _tensor(op.results[0]) if risk and len(op.results) else None
                if risk and out is not None and out[1] in HALF_DTYPES:
                    found.risks.append(Risk(risk, out[1], out[0], name, source))
    return found


# -- the backend's optimized HLO: text, the only form it has -------------------------------

# HLO's element type names.
_TYPE_NAMES = {
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
}
_HLO_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s(all-reduce|all-reduce-start|reduce-scatter|"
    r"all-gather|all-gather-start|all-to-all)\("
)


def _dtypes_in(text: str) -> tuple[str, ...]:
    return tuple(_TYPE_NAMES[t] for t in re.findall(r"\b(bf16|f16|f32|f64)\[", text))


# Bytes per element of HLO's element types.
_HLO_BYTES = {
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
    "u32": 4, "s64": 8, "u64": 8, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
_HLO_PARTITIONED = re.compile(
    r"=\s*(\(.*?\)|[\w]+\[[^\]]*\](?:\{[^}]*\})?)\s+(all-reduce|all-gather|reduce-scatter|"
    r"all-to-all|collective-permute)(?:-start)?\("
)


def _partitioned_collectives(text: str) -> list[Collective]:
    """The collectives of HLO text after SPMD partitioning, with bytes per device."""
    found = []
    for m in _HLO_PARTITIONED.finditer(text):
        arrays = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        shape = tuple(int(d) for d in arrays[0][1].split(",") if d) if arrays else ()
        size = sum(
            int(np.prod([int(d) for d in dims.split(",") if d])) * _HLO_BYTES.get(t, 4)
            for t, dims in arrays
        )
        dtypes = tuple(_TYPE_NAMES.get(t, t) for t, _ in arrays)
        line = text[m.end() : text.find("\n", m.end())]
        op_name = re.search(r'op_name="([^"]*)"', line)
        name = op_name.group(1) if op_name else ""
        found.append(Collective(m.group(2), dtypes, "partitioned", shape, size, name))
    return found


def _compile(lowered: Any) -> tuple[str | None, str | None]:
    """(the optimized HLO text, the HLO right after SPMD partitioning) of one compile. The
    second is None on one device, which has no such pass; on several, the compile dumps
    that pass to a temporary folder. The text is None where a backend gives none."""
    if len(jax.devices()) == 1:
        return lowered.compile().as_text(), None
    with tempfile.TemporaryDirectory() as folder:
        options = {"xla_dump_to": folder, "xla_dump_hlo_pass_re": "spmd-partitioning"}
        text = lowered.compile(compiler_options=options).as_text()
        names = sorted(n for n in os.listdir(folder) if "after_spmd-partitioning" in n)
        if not names:
            return text, None
        with open(os.path.join(folder, names[-1])) as f:
            return text, f.read()


# An instruction, its result dtype (the first element's for a tuple, which is what a GPU's
# library gemm returns: (bf16[m,n], s8[workspace])), opcode and the rest of the line.
_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(?(\w+)\[[^=]*?\s([\w\-]+)\((.*)$")
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
      matmuls: every dot_general and convolution of the lowered program, in program order
        (those of a function called from several places once per call). FP8 ones (see
        ``fp8_matmuls``) have half operands dequantized from float8 just before the op.
      converts: the number of dtype conversions.
      risks: float32-list ops (exp, log, rsqrt, sums, ...) that run in half precision. An
        exp that cannot overflow is left out: one of ``-x*x`` or ``-|x|`` (erf's derivative)
        or one that only feeds ``c / (k + exp)`` (JAX's lowering of sigmoid, so silu).
      untouched: primitives autocast did not know and ran in their traced dtype.
      compiled_matmuls: (kind, operand dtypes) of the matmuls in the backend's optimized HLO,
        or None if it could not be compiled. On CPU, XLA may run half matmuls in float32.
      backend: the backend the program was lowered for.
      collectives: all-reduces, reduce-scatters, all-gathers and all-to-alls with their
        dtypes, explicit ("lowered"), placed by the SPMD partitioner for sharded arrays
        ("partitioned", with bytes per device) and in the optimized program ("compiled").

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

    def collective_bytes(self) -> dict[str, int]:
        """Bytes per device that the partitioned program's collectives move, by dtype.

        Read from the HLO right after SPMD partitioning, before the backend widens or merges
        collectives: what a sharded step sends, in the dtypes it chose.

        Example:
          >>> import jax, jax.numpy as jnp, mpjax
          >>> mpjax.audit(lambda a: a @ a, jnp.ones((8, 8))).collective_bytes()  # one device
          {}
        """
        totals: dict[str, int] = {}
        for c in self.collectives:
            if c.stage == "partitioned" and c.dtypes:
                totals[c.dtypes[0]] = totals.get(c.dtypes[0], 0) + c.bytes
        return totals

    @property
    def total_flops(self) -> int:
        """FLOPs of all matmuls and convolutions.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> mpjax.audit(lambda a, b: a @ b, jnp.ones((4, 8)), jnp.ones((8, 2))).total_flops
          128
        """
        return sum(m.flops for m in self.matmuls)

    @property
    def half_flop_share(self) -> float:
        """The share of matmul/conv FLOPs whose operands are half (0.0 with no matmuls).

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> def f(a, b):  # two matmuls of the same size, one in float16
          ...     return a.astype(jnp.float16) @ b.astype(jnp.float16), a @ b
          >>> mpjax.audit(f, jnp.ones((8, 8)), jnp.ones((8, 8))).half_flop_share
          0.5
        """
        total = self.total_flops
        return sum(m.flops for m in self.matmuls if m.half) / total if total else 0.0

    @property
    def fp8_matmuls(self) -> tuple[MatmulOp, ...]:
        """The matmuls whose operands are float8 or dequantized from it right before them.

        Example:
          >>> import jax.numpy as jnp, mpjax, mpjax.fp8
          >>> f = lambda w, x: jnp.sum(x @ w)
          >>> pol = mpjax.fp8.policy("O2")
          >>> w, x = jnp.ones((32, 16)), jnp.ones((16, 32))
          >>> state = mpjax.fp8.init(f, pol, w, x)
          >>> report = mpjax.audit(mpjax.fp8.value_and_grad(f, pol), state, w, x)
          >>> [m.fp8_dtypes for m in report.fp8_matmuls], report.fp8_flop_share
          ([('float8_e4m3fn', 'float8_e4m3fn'), ('float8_e5m2', 'float8_e4m3fn')], 1.0)
        """
        return tuple(m for m in self.matmuls if m.fp8)

    @property
    def fp8_flop_share(self) -> float:
        """The share of matmul/conv FLOPs run in FP8 (0.0 with no matmuls).

        Example:
          >>> import jax.numpy as jnp, mpjax, mpjax.fp8
          >>> f, pol = lambda w, v, x: (x @ w) @ v, mpjax.fp8.policy()  # v too narrow for FP8
          >>> w, v, x = jnp.ones((32, 16)), jnp.ones((16, 8)), jnp.ones((16, 32))
          >>> state = mpjax.fp8.init(f, pol, w, v, x)
          >>> mpjax.audit(mpjax.fp8.apply(f, pol), state, w, v, x).fp8_flop_share
          0.8
        """
        total = self.total_flops
        return sum(m.flops for m in self.fp8_matmuls) / total if total else 0.0

    @property
    def misaligned(self) -> tuple[MatmulOp, ...]:
        """Half matmuls with a dimension that is not a multiple of 8 (slow on tensor cores).

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> f = lambda a, b: a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16)
          >>> report = mpjax.audit(f, jnp.ones((4, 12)), jnp.ones((12, 8)))
          >>> [m.operand_shapes for m in report.misaligned]   # 12 is not a multiple of 8
          [((4, 12), (12, 8))]
        """
        return tuple(m for m in self.matmuls if m.half and not m.aligned)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the report, for tests and CI.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> d = mpjax.audit(lambda a, b: a @ b, jnp.ones((8, 16)), jnp.ones((16, 8))).to_dict()
          >>> d["total_flops"], d["matmuls"][0]["kind"], d["matmuls"][0]["operand_dtypes"]
          (2048, 'dot_general', ('float32', 'float32'))
        """
        return {
            "backend": self.backend,
            "matmuls": [
                dataclasses.asdict(m) | {"half": m.half, "fp8": m.fp8} for m in self.matmuls
            ],
            "total_flops": self.total_flops,
            "half_flop_share": self.half_flop_share,
            "fp8_matmuls": len(self.fp8_matmuls),
            "fp8_flop_share": self.fp8_flop_share,
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
          >>> f = lambda w, x: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
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

    def assert_collectives_in(self, policy: Any, reference: AuditReport | None = None) -> None:
        """Raises AssertionError naming each collective that moves float32 (or float64) where
        `policy` computes in half, beyond what it asks for and what `reference` moves.

        Read from the program after SPMD partitioning (stage "partitioned"). Allowed wide:
        gradient reductions (the backward pass's all-reduces and reduce-scatters) when the
        policy reduces in float32 (:attr:`mpjax.Policy.reduce_dtype`), and, with a
        `reference` (the audit of the hand-written half step), the wide collectives it moves
        too, matched by kind, shape and dtype (a loss's or a norm's float32 statistics).
        Nothing to check on one device, or for a policy that computes in float32.

        Example:
          >>> import jax, jax.numpy as jnp, mpjax
          >>> policy = mpjax.Policy.from_level("O2", "bfloat16")
          >>> mpjax.audit(lambda a: a @ a, jnp.ones((8, 8))).assert_collectives_in(policy)
        """
        if not policy.half:
            return
        asked = np.dtype(policy.gradient_dtype).itemsize >= 4
        wide = [
            c
            for c in self.collectives
            if c.stage == "partitioned"
            and c.dtypes
            and c.dtypes[0] in ("float32", "float64")
            and not (
                asked and c.kind in ("all-reduce", "reduce-scatter") and "transpose(" in c.name
            )
        ]
        if reference is not None:
            key = lambda c: (c.kind, c.shape, c.dtypes[0] if c.dtypes else "")
            budget = collections.Counter(
                key(c) for c in reference.collectives if c.stage == "partitioned"
            )
            kept = []
            for c in wide:
                if budget[key(c)] > 0:
                    budget[key(c)] -= 1
                else:
                    kept.append(c)
            wide = kept
        if wide:
            lines = [
                f"  {c.kind} {c.dtypes[0]}{list(c.shape)} {c.bytes} B/device "
                f"({c.name or 'unnamed'})"
                for c in wide
            ]
            raise AssertionError(
                f"{len(wide)} collectives move {wide[0].dtypes[0]} where the policy "
                f"({policy}) computes in {np.dtype(policy.compute_dtype).name} and reduces "
                f"gradients in {np.dtype(policy.gradient_dtype).name}:\n" + "\n".join(lines)
            )

    def __str__(self) -> str:
        fp8 = self.fp8_matmuls
        fp8_note = (
            f" ({len(fp8)} matmuls, {100 * self.fp8_flop_share:.1f}% of FLOPs, in FP8)"
            if fp8
            else ""
        )
        rows = [
            f"mpjax audit ({self.backend}): {len(self.matmuls)} matmuls, "
            f"{100 * self.half_flop_share:.1f}% of {self.total_flops:,} FLOPs in half{fp8_note}, "
            f"{self.converts} converts, {len(self.risks)} f32-list ops in half",
            "",
            "| op | operands | result | shapes | GFLOP | tensor-core aligned | where |",
            "|---|---|---|---|---:|---|---|",
        ]
        for m in self.matmuls:
            shapes = " x ".join("[" + ",".join(map(str, s)) + "]" for s in m.operand_shapes)
            operands = " x ".join(
                d if q is None else f"{q}->{d}"
                for d, q in zip(m.operand_dtypes, m.fp8_dtypes or (None,) * 2, strict=False)
            )
            rows.append(
                f"| {m.kind} | {operands} | {m.result_dtype} | {shapes} | "
                f"{m.flops / 1e9:.4f} | {'yes' if m.aligned else 'no'} | "
                f"{_where(m.name, m.source)} |"
            )
        if self.risks:
            rows += ["", "f32-list ops in half (overflow/accuracy risks):"]
            rows += [
                f"  {r.op} {r.dtype}{list(r.shape)} at {_where(r.name, r.source)}"
                for r in self.risks
            ]
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


# The parts of a name stack that JAX adds: transformations wrapping the scope they entered
# (``transpose(jvp(Net))``), function calls (``jit(step)``, ``pmap(f)``), and the regions of
# control flow and remat. What is left is what the user's code named: Flax's module path
# (``Net/Dense_0``) and any ``jax.named_scope``.
_TRANSFORM = re.compile(r"(?:jvp|transpose|vmap)\((.*)\)")
_CALL_SCOPE = re.compile(r"\w+\(.*\)")
_JAX_SCOPE = re.compile(r"cond|while|body|body_pred|branch_\d+_fun|checkpoint|rematted_computation")


def _module_path(name: str | None) -> str | None:
    """The module path in an op's name stack, ``Net/Dense_0`` from
    ``jit(step)/transpose(jvp(Net))/Dense_0/dot_general``; None where it has none."""
    path: list[str] = []
    for part in (name or "").split("/")[:-1]:  # the last part is the primitive
        while (m := _TRANSFORM.fullmatch(part)) is not None:
            part = m.group(1)
        if not part or _CALL_SCOPE.fullmatch(part) or _JAX_SCOPE.fullmatch(part):
            continue
        if part.startswith(("mpjax:", UNTOUCHED_SCOPE + ":")):
            continue
        if not path or path[-1] != part:  # a transformation re-entering the same module
            path.append(part)
    return "/".join(path) or None


def _where(name: str | None, source: str | None) -> str:
    """``Net/Dense_0 (linear.py:287)``: a library's line is the same for each of its layers,
    so the module path tells them apart."""
    path = _module_path(name)
    if path is None:
        return _short(source)
    return f"{path} ({_short(source)})" if source else path


def _lower(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """`fn` lowered at `args` and `kwargs`: by its own ``lower`` where that gives JAX's
    ``Lowered``, else by a jit of `fn` over the array leaves, the other leaves static."""
    if hasattr(fn, "lower"):
        # A jitted function's own lowering keeps what only a top-level jit may carry
        # (compiler_options, donation, static_argnums); nested in another jit, JAX rejects it.
        try:
            own = fn.lower(*args, **kwargs)
        except TypeError:  # a leaf jax.jit takes for no array (a module's activation function)
            own = None
        if hasattr(own, "compiler_ir"):  # eqx.filter_jit's own Lowered has none
            return own
    # Split as autocast splits them: arrays (and shape structs standing for arrays) are the
    # program's inputs; any other leaf is static, baked into the trace.
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [
        i for i, x in enumerate(leaves) if _is_dynamic(x) or isinstance(x, jax.ShapeDtypeStruct)
    ]

    flat = flat_call(fn, leaves, treedef, dynamic)
    flat.__name__ = getattr(fn, "__name__", type(fn).__name__)  # ops still read jit(<name>)/
    return jax.jit(flat).lower(*[leaves[i] for i in dynamic])


def audit(fn: Callable[..., Any], *args: Any, compile: bool = True, **kwargs: Any) -> AuditReport:
    """Reports what `fn` runs in which precision, read from its lowered program.

    Lowers ``fn(*args, **kwargs)`` (jitted or not) to StableHLO and walks the module through
    the MLIR Python bindings (its text changes between JAX releases; its structure does not):
    loop, conditional and collective regions in place, and each called function's body at its
    call. It lists every dot_general and convolution with operand and result dtypes, shapes,
    FLOPs and source location; counts converts; flags float32-list ops (exp, log, rsqrt,
    sums, ...) that run in half; and advises on half matmuls not aligned to 8 (tensor cores).
    A matmul whose operands are dequantized from float8 right before it (as ``mpjax.fp8``
    runs its sites) counts as FP8: ``report.fp8_matmuls`` and ``report.fp8_flop_share``.
    With `compile`, it also reads the backend's optimized HLO (text, the only form XLA gives)
    to show the dtypes the matmuls really run in.

    It takes anything :func:`mpjax.autocast` accepts: `fn` plain, jitted (``jax.jit``,
    ``eqx.filter_jit``) or autocast, its arguments pytrees whose array leaves (or
    ``jax.ShapeDtypeStruct``) are the program's inputs. Any other leaf (an equinox module's
    activation function, a Python number, a string) is static: baked into the program, as
    jax.jit's static arguments are.

    The table's "where" column is the op's source line (``model.py:12``). Where the op's name
    stack holds a module path (Flax linen's, equinox's, a ``jax.named_scope``), the path comes
    first: ``Net/Dense_0 (linear.py:287)``, since every Dense runs Flax's same line. NNX
    records no path, so its rows show the line alone.

    Args:
      fn: the function, e.g. a jitted train step.
      *args: its arguments: pytrees of arrays or ``jax.ShapeDtypeStruct``, and static leaves.
      compile: also compile and read the optimized HLO (default True).
      **kwargs: its keyword arguments.

    Returns:
      An :class:`AuditReport`.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> def f(w, x):  # all in float16 by hand, softmax's exp included
      ...     return jax.nn.softmax(x.astype(jnp.float16) @ w.astype(jnp.float16))
      >>> report = mpjax.audit(f, jnp.ones((16, 8)), jnp.ones((4, 16)))
      >>> report.half_flop_share, [r.op for r in report.risks]
      (1.0, ['exp'])
      >>> layer = lambda w, x, act: act(x @ w)  # act, a function, is a static leaf
      >>> len(mpjax.audit(layer, jnp.ones((16, 8)), jnp.ones((4, 16)), jax.nn.relu).matmuls)
      1

      Under ``mpjax.autocast(f, mpjax.Policy.from_level("O1", "float16"))`` the matmul stays
      in float16 and the exp runs in float32, so ``report.risks`` is empty.
    """
    if not callable(fn):
        raise TypeError(f"audit needs a function, got {type(fn).__name__}.")
    lowered = _lower(fn, args, kwargs)
    found = _read_module(lowered.compiler_ir("stablehlo"))
    compiled = None
    if compile:
        try:
            text, partitioned = _compile(lowered)
            if text is not None:
                compiled_matmuls, inserted = _parse_compiled(text)
                compiled = tuple(compiled_matmuls)
                found.collectives += inserted
            if partitioned is not None:
                found.collectives += _partitioned_collectives(partitioned)
        except Exception:  # noqa: BLE001 - the report stands without the optimized HLO
            compiled = None
    return AuditReport(
        matmuls=tuple(found.matmuls),
        converts=found.converts,
        risks=tuple(found.risks),
        untouched=tuple(found.untouched),
        compiled_matmuls=compiled,
        backend=jax.default_backend(),
        collectives=tuple(found.collectives),
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
        what = f"{self.dtype}{list(self.shape)}"
        if self.primitive == "input":
            return f"{self.kind} in the input {self.name} ({what})"
        if self.primitive == "constant":
            return f"{self.kind} in a constant the function closes over ({what})"
        return (
            f"{self.kind} first produced by {self.primitive} -> {what} "
            f"in {self.name or '<top level>'} at {self.source or 'unknown source'}"
        )


_CALL_PARAMS = {
    **INLINE_CALLS,
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",  # JAX 0.6's name of custom_vjp_call
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}


def _nonfinite_kind(x: Any) -> str | None:
    """'nan' or 'inf' if the floating array `x` holds one (nan first), else None."""
    # jnp.issubdtype, not np: a PRNG key's dtype (key<fry>) is not a NumPy dtype.
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)):
        return None
    arr = np.asarray(x, np.float64) if np.dtype(x.dtype).itemsize <= 8 else np.asarray(x)
    if np.isnan(arr).any():
        return "nan"
    if np.isinf(arr).any():
        return "inf"
    return None


def _nonfinite_input(
    named: list[tuple[str, Any]], primitive: str, kinds: tuple[str, ...] = ("nan", "inf")
) -> NonFiniteOrigin | None:
    """The first of `named` (name, value) holding one of `kinds`, as an origin."""
    for name, x in named:
        kind = _nonfinite_kind(x)
        if kind in kinds:
            return NonFiniteOrigin(
                primitive=primitive,
                name=name,
                source=None,
                dtype=str(np.dtype(x.dtype)),
                shape=tuple(np.shape(x)),
                kind=kind,
            )
    return None


def _first_nonfinite(jaxpr: Any, consts: list, args: list, stack: str) -> Any:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jax_compat.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = "/".join(p for p in (stack, str(eqn.source_info.name_stack)) if p)
        key = _CALL_PARAMS.get(eqn.primitive.name)
        if key is not None and all(_nonfinite_kind(x) is None for x in invals):
            sub = eqn.params[key]
            sub_jaxpr, sub_consts = (
                (sub.jaxpr, list(sub.consts)) if hasattr(sub, "consts") else (sub, [])
            )
            found, outs = _first_nonfinite(sub_jaxpr, sub_consts, invals, name)
            if found is not None:
                return found, None
        else:
            outs = jax_compat.bind(eqn.primitive, invals, eqn.params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            kinds = [_nonfinite_kind(x) for x in outs]
            if any(kinds) and all(_nonfinite_kind(x) is None for x in invals):
                out = outs[[k is not None for k in kinds].index(True)]
                return NonFiniteOrigin(
                    primitive=eqn.primitive.name,
                    name=name,
                    source=jax_compat.summarize_source(eqn.source_info),
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

    When no op made one, an inf or nan that came in with the arguments is reported:
    ``primitive`` is ``"input"`` and ``name`` the argument's path (``"args[1]['x']"``); then a
    nan in a value `fn` closes over (``"constant"``; an inf there is usually a mask's fill).

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
    paths, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in paths]
    for leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, float, int, bool)):
            raise TypeError(
                f"find_nonfinite takes arrays (or pytrees of arrays), got a {type(leaf).__name__}; "
                "close over other arguments with functools.partial."
            )
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    found, _ = _first_nonfinite(closed.jaxpr, list(closed.consts), leaves, "")
    if found is None:
        found = _nonfinite_input(
            [(("args", "kwargs")[p[0].idx] + jax.tree_util.keystr(p[1:]), x) for p, x in paths],
            "input",
        )
    if found is None:  # an inf constant is usually a mask's fill: only a nan is reported
        found = _nonfinite_input([("", c) for c in closed.consts], "constant", kinds=("nan",))
    return found
