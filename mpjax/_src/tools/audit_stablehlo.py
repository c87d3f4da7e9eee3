"""The audit's reading of a lowered StableHLO module, walked through the MLIR Python bindings:
matmuls and their dtypes, converts, half-precision risks and collectives."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

from mpjax._src.interpreter.first_order import UNTOUCHED_SCOPE, untouched_reason
from mpjax._src.tools.audit_report import HALF_DTYPES, Collective, MatmulOp, Risk

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
_STATISTIC_OPS = {"stablehlo.add": "reduce_sum", "stablehlo.multiply": "reduce_prod"}
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
    if name.startswith(("f8", "f4")):  # f8E4M3FN -> float8_e4m3fn, NumPy's (ml_dtypes') name
        return f"float{name[1]}_" + name[2:].lower()
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
    """The float8 (or NVFP4's float4) dtype `value` holds or was dequantized from (a convert
    from it, then scales, converts and layout changes), or None. Follows results of called
    functions and of optimization barriers (remat); stops at block arguments (loop carries)."""
    t = _tensor(value)
    if t is not None and t[1].startswith(("float8", "float4")):
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
    return _STATISTIC_OPS.get(body[0]) if len(body) == 2 and body[1] == "stablehlo.return" else None


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
    untouched_why: list[str] = dataclasses.field(default_factory=list)
    collectives: list[Collective] = dataclasses.field(default_factory=list)


def read_module(module: Any) -> _Lowered:
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
                # "mpjax_untouched:shard_map:not-rebuilt": the primitive, then why (if given).
                scope = re.split(r"[/)]", name.split(UNTOUCHED_SCOPE + ":", 1)[1], maxsplit=1)[0]
                prim, _, code = scope.partition(":")
                if prim not in found.untouched:
                    found.untouched.append(prim)
                    found.untouched_why.append(untouched_reason(prim, code))
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
