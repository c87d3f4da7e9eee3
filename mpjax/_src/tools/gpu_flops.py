"""The FLOPs of a GPU or TPU program's matmul kernels, counted from the optimized HLO's shapes
(:mod:`gpu_program` times them by its roofline): gemms, cuDNN and TPU convolutions, cuDNN's
fused attention and block-scaled dots."""

from __future__ import annotations

import math
import re

from mpjax._src.tools.hlo_text import _arrays, _called, _Computation, _find, _find_all, _Instr


def _dot_flops(shape: str, lhs_shape: str, contracting: list[int]) -> float:
    """2 * result elements * contracted size: a gemm's multiply-adds, counted twice."""
    out, lhs = _arrays(shape), _arrays(lhs_shape)
    if not out or not lhs:
        return 0.0
    k = math.prod(lhs[0][1][d] for d in contracting if d < len(lhs[0][1]))
    return 2.0 * math.prod(out[0][1]) * k


def _gemm_flops(ins: _Instr, comp: _Computation, comps: dict[str, _Computation]) -> float:
    """The FLOPs of a gemm kernel: a cuBLAS call (its backend config names the lhs's
    contracting dimensions) or a fusion around a dot."""
    if ins.opcode == "custom-call" and "blockScaledDot" in ins.attrs:
        # [B, M, K] x [B, N, K] -> [B, M, N], the block scales beside
        lhs = _arrays(comp.shapes.get(ins.operands[0], "")) if ins.operands else []
        return (
            _dot_flops(ins.shape, comp.shapes.get(ins.operands[0], ""), [len(lhs[0][1]) - 1])
            if lhs
            else 0.0
        )
    if ins.opcode == "custom-call":
        found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
        if not found or not ins.operands:
            return 0.0
        dims = [int(d.strip().strip('"')) for d in found.group(1).split(",") if d.strip()]
        return _dot_flops(ins.shape, comp.shapes.get(ins.operands[0], ""), dims)
    dot = _find(comps, _called(ins.attrs), "dot")
    if dot is None or not dot.operands:
        return 0.0
    found = re.search(r"lhs_contracting_dims=\{([^}]*)\}", dot.attrs)
    dims = [int(d) for d in found.group(1).split(",") if d.strip()] if found else []
    scope = next((c for c in comps.values() if dot.operands[0] in c.shapes), None)
    return _dot_flops(dot.shape, scope.shapes[dot.operands[0]] if scope else "", dims)


def _conv_flops(ins: _Instr, comp: _Computation) -> float:
    """2 * output elements * window size * input features / groups (XLA's HloCostAnalysis
    rule), read from a cuDNN convolution call's ``window=`` and ``dim_labels=``: forward,
    backward-input and backward-filter calls alike are each a convolution of their operands,
    with the forward's labels."""
    window = re.search(r"window=\{size=([\dx]+)", ins.attrs)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not window or not labels or not ins.operands:
        return 0.0
    shapes = [_arrays(comp.shapes.get(o, "")) for o in ins.operands[:2]]
    ops = [a[0][1] if a else () for a in shapes]
    result = _arrays(ins.shape)
    res = result[0][1] if result else ()
    if "BackwardInput" in ins.attrs:
        lhs, out = res, ops[0]
    elif "BackwardFilter" in ins.attrs and len(ops) > 1:
        lhs, out = ops[0], ops[1]
    else:
        lhs, out = ops[0], res
    f = labels.group(1).find("f")
    if f < 0 or f >= len(lhs):
        return 0.0
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    size = math.prod(int(n) for n in window.group(1).split("x"))
    return 2.0 * math.prod(out) * size * lhs[f] / (int(groups.group(1)) if groups else 1)


def _taps(out: int, size: int, stride: int, pad: int, lhs_dil: int, rhs_dil: int, n: int) -> int:
    """Over one spatial dimension of a convolution, the (output position, window tap) pairs
    that meet an input element (not padding, not a hole of lhs dilation)."""
    hits = [p * stride + k * rhs_dil - pad for p in range(out) for k in range(size)]
    return sum(1 for x in hits if 0 <= x <= (n - 1) * lhs_dil and x % lhs_dil == 0)


def _window(attrs: str, key: str, dims: int, default: int) -> list[int]:
    found = re.search(rf"\b{key}=([\dx_-]+)", attrs)  # a pad's low side ("1_2" is 1)
    return [int(v.split("_")[0]) for v in found.group(1).split("x")] if found else [default] * dims


def _fused_conv_flops(conv: _Instr, comps: dict[str, _Computation]) -> float:
    """A convolution op's FLOPs, counting only products with input elements: a TPU runs its
    batched matmuls as convolutions whose window walks a dilated input, mostly holes."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", conv.attrs)
    if not labels or len(conv.operands) < 2:
        return 0.0
    scope = next((c for c in comps.values() if conv.operands[0] in c.shapes), None)
    if scope is None:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs = (_arrays(scope.shapes[conv.operands[0]]) or [("", ())])[0][1]
    rhs = (_arrays(scope.shapes.get(conv.operands[1], "")) or [("", ())])[0][1]
    out = (_arrays(conv.shape) or [("", ())])[0][1]
    if len(lhs) != len(lhs_l) or len(rhs) != len(rhs_l) or len(out) != len(out_l):
        return 0.0
    spatial = sorted(c for c in out_l if c.isdigit())
    size = _window(conv.attrs, "size", len(spatial), 1)
    stride = _window(conv.attrs, "stride", len(spatial), 1)
    lhs_dil = _window(conv.attrs, "lhs_dilate", len(spatial), 1)
    rhs_dil = _window(conv.attrs, "rhs_dilate", len(spatial), 1)
    pad = _window(conv.attrs, "pad", len(spatial), 0)
    pairs = math.prod(
        _taps(out[out_l.index(d)], size[i], stride[i], pad[i], lhs_dil[i], rhs_dil[i],
              lhs[lhs_l.index(d)])
        for i, d in enumerate(spatial)
    )  # fmt: skip
    return 2.0 * pairs * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")]


def _flops(kind: str, ins: _Instr, comp: _Computation, comps: dict[str, _Computation]) -> float:
    """A kernel's gemm or cuDNN convolution FLOPs; 0 for any other kernel."""
    if kind == "gemm" and ins.opcode == "fusion" and "kind=kOutput" in ins.attrs:
        # a TPU fusion: its matmuls, a recomputed forward one included
        convs = _find_all(comps, _called(ins.attrs), "convolution")
        if convs:
            return sum(_fused_conv_flops(c, comps) for c in convs)
    if kind == "gemm":
        return _gemm_flops(ins, comp, comps)
    if kind == "conv" and ins.opcode == "custom-call":
        return _conv_flops(ins, comp)
    if kind == "attention":
        return _attention_flops(ins, comp)
    return 0.0


def _attention_flops(ins: _Instr, comp: _Computation) -> float:
    """A cuDNN fused attention's matmul FLOPs, from its shapes: each of its matmuls is 2 * B *
    H * T * S * D (the scores' B, H, T, S from its backend config, D the query's last
    dimension): two forward (QK^T, PV), five backward (the scores again, dV, dP, dQ, dK); half
    of them under a causal mask, whose masked blocks it skips."""
    scores = re.search(
        r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', ins.attrs
    )
    query = _arrays(comp.shapes.get(ins.operands[0], "")) if ins.operands else []
    if not scores or not query or not query[0][1]:
        return 0.0
    area = math.prod(int(d.strip().strip('"')) for d in scores.group(1).split(",") if d.strip())
    matmuls = 5 if "Backward" in ins.attrs.split("custom_call_target=", 1)[-1][:60] else 2
    causal = 0.5 if re.search(r'"mask_type":\s*"[A-Z_]*CAUSAL', ins.attrs) else 1.0
    return 2.0 * matmuls * area * query[0][1][-1] * causal
