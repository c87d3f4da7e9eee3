"""FP8 matmuls: quantize-dequantize, and dot_general in float8 with delayed, current (per
tensor) and per-row scales, each a custom derivative whose backward gemms are FP8 too."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from mpjax._src import hardware
from mpjax._src.float8.quantize_kernel import (
    E2M1,
    NV_BLOCK,
    e2m1_magnitude,
    hadamard,
    hash_uniform,
    mx_blocks,
    nv_blocks,
    nv_tensor_scale,
    tiles_fit,
)
from mpjax._src.float8.quantize_kernel import mx_quantize_both as mx_quantize_both_kernel
from mpjax._src.float8.quantize_kernel import nv_quantize_both as nv_quantize_both_kernel
from mpjax._src.float8.quantize_kernel import rows_quantize_both as rows_quantize_both_kernel

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
# The three tensors of a dot site: activations and weights (forward), gradients (backward).
INPUT, KERNEL, GRAD = 0, 1, 2


# -- quantization --------------------------------------------------------------------------------


def finite_max(dtype: Any) -> float:
    """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(jnp.finfo(dtype).max)


def qdq(x: jax.Array, q_dtype: DTypeLike, scale: jax.Array) -> jax.Array:
    """Quantizes `x` to `q_dtype` with `scale` (saturating) and dequantizes it to x's dtype.

    The same arithmetic as ``flax.linen.fp8_ops.qdq(x, q_dtype, 1 / scale, x.dtype)``: flax
    keeps the inverse (dequantization) scale, mpjax keeps TransformerEngine's.

    Args:
      x: a floating array.
      q_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      scale: a scalar: ``x * scale`` is what is stored in FP8.

    Returns:
      ``x`` rounded through FP8, in x's dtype.

    Example:
      >>> import jax.numpy as jnp, mpjax.fp8
      >>> x = jnp.array([1.0, 0.3, 1000.0])
      >>> mpjax.fp8.qdq(x, jnp.float8_e4m3fn, jnp.float32(1.0)).tolist()
      [1.0, 0.3125, 448.0]
    """
    check_scale(scale, "qdq's scale")
    dt = x.dtype
    inv = (1.0 / scale.astype(jnp.float32)).astype(dt)
    lim = jnp.asarray(finite_max(q_dtype), dt)
    q = jnp.clip(x / jnp.broadcast_to(inv, x.shape), -lim, lim).astype(q_dtype)
    return q.astype(dt) * jnp.broadcast_to(inv, x.shape)


def gemm_dtype(dtype: Any) -> Any:
    """The dtype an FP8 gemm writes before its scales multiply the result: float32 for a
    float16 result (operands scaled toward 448 make products whose sum passes float16's
    65504 before the scales bring it back), else the result's own dtype (bfloat16 has
    float32's range). XLA folds the scales and the cast to float16 into the gemm."""
    return np.dtype(np.float32) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


def _descaled(acc: jax.Array, inverse: Any, out: Any) -> jax.Array:
    """A gemm's result `acc` (in ``gemm_dtype(out)``) times its inverse scales, rounded once to
    `out`."""
    return (acc * inverse.astype(acc.dtype)).astype(out)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _amax_beside(x: jax.Array) -> jax.Array:
    """``_amax(x)`` for an amax that no cast waits on (delayed scaling's, which the next
    step's scale reads), as each target fuses it beside the cast. On a TPU it is reduced in
    float32 (the same number: the cast up, abs and max are exact), which the TPU fuses into
    the kernel that makes `x` and casts it, as a second output; reduced in the half, it
    reads `x` again in a kernel of its own (TPU7x's FP8 step: 7.01 -> 6.62 ms modeled). A
    GPU's program is the other way round (the B200's step 7.83 against 7.78 ms)."""
    amax: jax.Array = lax.platform_dependent(
        x, tpu=lambda x: _amax(x.astype(jnp.float32)), default=_amax
    )
    return amax


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def fp8_dot_general(
    dimension_numbers: Any,
    precision: Any,
    preferred_element_type: Any,
    lhs: jax.Array,
    rhs: jax.Array,
    scale: jax.Array,
    amax_sink: jax.Array,
) -> jax.Array:
    """``lax.dot_general`` through FP8 (HYBRID): E4M3 operands, E5M2 output gradient.

    `scale` holds the input, kernel and gradient scales (float32 ``[3]``). `amax_sink` is
    a float32 ``[3]`` value that only serves to carry amaxes out: its gradient is
    ``[amax(lhs), amax(rhs), amax(output gradient)]``, each with the gradient of this one dot.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax.fp8
      >>> x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
      >>> dims = (((1,), (0,)), ((), ()))
      >>> f = lambda x, s: mpjax.fp8.fp8_dot_general(dims, None, None, x, w, jnp.ones(3), s)
      >>> jax.grad(lambda s: f(x, s).sum() * 0.5, )(jnp.zeros(3))
      Array([1. , 1. , 0.5], dtype=float32)
    """
    out, _ = _fp8_fwd(dimension_numbers, precision, preferred_element_type, lhs, rhs, scale,
                      amax_sink)  # fmt: skip
    return out


def quantize(x: jax.Array, q_dtype: Any, scale: jax.Array) -> jax.Array:
    """``x * scale`` rounded to `q_dtype`, saturating at its largest finite value."""
    lim = finite_max(q_dtype)
    scaled = x.astype(jnp.float32) * scale.astype(jnp.float32)
    return jnp.clip(scaled, -lim, lim).astype(q_dtype)


def _remaining(n: int, *removed: Sequence[int]) -> list[int]:
    gone = {i for r in removed for i in r}
    return [i for i in range(n) if i not in gone]


def _transpose_lhs(
    g: jax.Array, lhs_ndim: int, rhs: jax.Array, dims: Any, swap: bool, out: Any
) -> Any:
    """The cotangent of a dot_general's lhs for output cotangent `g`, as a dot of float8
    operands with result type `out` (JAX's own transpose rule, ``_dot_general_transpose_lhs``,
    which would give the result the operand's type: float8)."""
    (lc, rc), (lb, rb) = dims
    lkept = _remaining(lhs_ndim, lc, lb)
    rkept = _remaining(rhs.ndim, rc, rb)
    nb = len(lb)
    # The output's axes are (batch, lhs kept, rhs kept), or (batch, rhs kept, lhs kept) for
    # the rhs's cotangent, which calls this with the operands swapped.
    first = nb if swap else nb + len(lkept)
    ans_r = tuple(range(first, first + len(rkept)))
    new_dims = ((ans_r, tuple(rkept)), (tuple(range(nb)), tuple(rb)))
    lc_by_r = [lc[i] for i in np.argsort(rc)]
    out_axes = np.argsort(list(lb) + lkept + lc_by_r)
    res = lax.dot_general(g, rhs, new_dims, preferred_element_type=out)
    return lax.transpose(res, tuple(int(a) for a in out_axes))


def _fp8_fwd(
    dims: Any,
    precision: Any,
    pref: Any,
    lhs: Any,
    rhs: Any,
    scale: Any,
    amax_sink: Any,
    amaxes: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, Any]:
    # The dot takes float8 operands and writes the half (or float32) result, which the
    # scales then multiply; XLA folds them into the gemm's epilogue. XLA's GPU pipeline runs
    # such a dot as an FP8 gemm (cuBLASLt or Triton) with no pattern to match
    # (TransformerEngine's and Flax's quantize-dequantize pairs are lost to run-time scales).
    # The float8 operands are the residuals.
    del amax_sink, precision
    lq = quantize(lhs, E4M3, scale[INPUT])
    rq = quantize(rhs, E4M3, scale[KERNEL])
    out_dtype = pref or jnp.result_type(lhs, rhs)
    acc = lax.dot_general(lq, rq, dims, preferred_element_type=gemm_dtype(out_dtype))
    out = _descaled(acc, 1.0 / (scale[INPUT] * scale[KERNEL]), out_dtype)
    like = (jnp.zeros([], lhs.dtype), jnp.zeros([], rhs.dtype))  # the cotangents' dtypes
    # the amaxes current scaling took already, else delayed scaling's (no cast waits on them)
    amax_l, amax_r = amaxes if amaxes is not None else (_amax_beside(lhs), _amax_beside(rhs))
    return out, (lq, rq, scale, amax_l, amax_r, *like)


def _fp8_bwd(
    dims: Any, precision: Any, pref: Any, res: Any, g: jax.Array, amax_g: Any = None
) -> tuple[Any, ...]:
    lq, rq, scale, amax_l, amax_r, l_like, r_like = res
    gq = quantize(g, E5M2, scale[GRAD])
    (lc, rc), (lb, rb) = dims
    # As forward: each cotangent in its operand's dtype, the scales folded into the gemm.
    ldt, rdt = l_like.dtype, r_like.dtype
    dl = _transpose_lhs(gq, lq.ndim, rq, dims, False, gemm_dtype(ldt))
    dl = _descaled(dl, 1.0 / (scale[GRAD] * scale[KERNEL]), ldt)
    swapped = ((rc, lc), (rb, lb))
    dr = _transpose_lhs(gq, rq.ndim, lq, swapped, True, gemm_dtype(rdt))
    dr = _descaled(dr, 1.0 / (scale[GRAD] * scale[INPUT]), rdt)
    amaxes = jnp.stack([amax_l, amax_r, _amax_beside(g) if amax_g is None else amax_g])
    return dl, dr, jnp.zeros_like(scale), amaxes


fp8_dot_general.defvjp(_fp8_fwd, _fp8_bwd)


def scale_of(amax: jax.Array, fp8_max: Any, margin: int, fallback: Any) -> Any:
    """``fp8_max / amax / 2**margin``, and `fallback` where the amax is zero or not finite
    (TransformerEngine's rule); and where it was not."""
    ok = (amax > 0.0) & jnp.isfinite(amax)
    return jnp.where(ok, fp8_max / jnp.where(ok, amax, 1.0) / 2.0**margin, fallback), ok


def _current_scale(amax: jax.Array, q_dtype: Any, margin: int) -> jax.Array:
    return scale_of(amax, finite_max(q_dtype), margin, 1.0)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def fp8_dot_current(dims: Any, pref: Any, margin: int, lhs: Any, rhs: Any, sink: Any) -> Any:
    """fp8_dot_general with current scaling: each tensor's scale from its own amax."""
    return _current_fwd(dims, pref, margin, lhs, rhs, sink)[0]


def _current_fwd(dims: Any, pref: Any, margin: int, lhs: Any, rhs: Any, sink: Any) -> Any:
    amax_l, amax_r = _amax(lhs), _amax(rhs)
    scale = jnp.stack(
        [
            _current_scale(amax_l, E4M3, margin),
            _current_scale(amax_r, E4M3, margin),
            jnp.float32(1.0),  # the gradient's: set from its amax in the backward pass
        ]
    )
    return _fp8_fwd(dims, None, pref, lhs, rhs, scale, sink, (amax_l, amax_r))


def _current_bwd(dims: Any, pref: Any, margin: int, res: Any, g: Any) -> Any:
    lq, rq, scale, *rest = res
    amax_g = _amax(g)
    scale = scale.at[GRAD].set(_current_scale(amax_g, E5M2, margin))
    dl, dr, _, amaxes = _fp8_bwd(dims, None, pref, (lq, rq, scale, *rest), g, amax_g)
    return dl, dr, amaxes


fp8_dot_current.defvjp(_current_fwd, _current_bwd)


def _rows_quantized(x: Any, axis: int, q_dtype: Any, margin: int) -> Any:
    """`x` in `q_dtype`, each row along `axis` (the axis a gemm contracts) with its own
    current scale; and the scales (keepdims) and x's amax (the max of its rows')."""
    rows = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32)
    scale = _current_scale(rows, q_dtype, margin)
    return quantize(x, q_dtype, scale), scale, jnp.max(rows)


def _row_gemm(qa: Any, sa: Any, a_axis: int, qb: Any, sb: Any, b_axis: int, out: Any) -> Any:
    """``qa @ qb`` over [B, ., .] float8 operands, contracting qa's `a_axis` with qb's
    `b_axis`, each quantized per row along it with scales `sa`, `sb`; the scales multiply
    the result (its axes: qa's kept axis, then qb's)."""
    acc = lax.dot_general(
        qa, qb, (((a_axis,), (b_axis,)), ((0,), (0,))), preferred_element_type=gemm_dtype(out)
    )
    inv_a = jnp.reshape(1.0 / sa, (sa.shape[0], -1, 1))  # sa is [B, M, 1] or [B, 1, M]
    inv_b = jnp.reshape(1.0 / sb, (sb.shape[0], 1, -1))
    return _descaled(acc, inv_a * inv_b, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_bmm_rows(pref: Any, margin: int, a: Any, b: Any, sink: Any) -> Any:
    """``a @ b`` for a [B, M, K] and b [B, K, N] through FP8 with per-row current scales."""
    return _rows_fwd(pref, margin, a, b, sink)[0]


def _row_scales(x: Any, q_dtype: Any, margin: int) -> tuple[Any, Any, Any]:
    """The current per-row scales of `x` [B, R, C] along C ([B, R, 1]) and along R ([B, 1,
    C]), and x's amax."""
    rows = jnp.max(jnp.abs(x), axis=2, keepdims=True).astype(jnp.float32)
    cols = jnp.max(jnp.abs(x), axis=1, keepdims=True).astype(jnp.float32)
    scale = lambda amax: _current_scale(amax, q_dtype, margin)
    return scale(rows), scale(cols), jnp.max(rows)


def _rows_both(x: Any, q_dtype: Any, margin: int, kernel: bool) -> Any:
    """((x along C [B, R, C], its scales [B, R, 1]), (x along R, its scales [B, 1, C]), amax):
    both per-row copies. On a GPU that writes float8 from its own kernels (`kernel`), one
    Pallas kernel writes both from one read (the copy along R transposed, [B, C, R], which
    the gemm reads as x's layout); elsewhere XLA's passes (the copy along R as [B, R, C])."""
    if kernel and tiles_fit(*x.shape[1:]) and hardware.one_device():
        row_scale, col_scale, amax = _row_scales(x, q_dtype, margin)
        rows, cols = rows_quantize_both_kernel(x, row_scale, col_scale, q_dtype=q_dtype)
        return (rows, row_scale), (jnp.swapaxes(cols, 1, 2), col_scale), amax
    q, s, amax = _rows_quantized(x, 2, q_dtype, margin)
    return (q, s), _rows_quantized(x, 1, q_dtype, margin)[:2], amax


def _rows_fwd(pref: Any, margin: int, a: Any, b: Any, sink: Any) -> Any:
    # Each operand is contracted along one axis forward and along the other backward, so
    # it is quantized twice; the backward copies are the residuals. The barrier writes the
    # weight's two copies in one pass before its forward gemm. Left to XLA, the backward
    # copy is made where it is used, in a pass fused into the optimizer's update of the
    # same weight, which then runs mid-backward and holds its outputs from there (the step
    # keeps 1.7x O2's temp memory), or, where the step donates its buffers, in a pass of
    # its own (0.6 ms more in the H100 program of benchmarks/fp8_program.py).
    del sink
    kernel = hardware.fp8_kernels()
    (qa, sa), a_by_m, amax_a = _rows_both(a, E4M3, margin, kernel)  # a_by_m: for db
    b_by_n, (qb, sb), amax_b = _rows_both(b, E4M3, margin, kernel)  # b_by_n: for da
    # The barrier keeps XLA from moving the weight's backward copy to where it is used.
    qb, b_by_n = lax.optimization_barrier((qb, b_by_n))
    out = _row_gemm(qa, sa, 2, qb, sb, 1, pref)
    like = (jnp.zeros([], a.dtype), jnp.zeros([], b.dtype))  # the cotangents' dtypes
    return out, (a_by_m, b_by_n, amax_a, amax_b, *like)


def _rows_bwd(pref: Any, margin: int, res: Any, g: Any) -> Any:
    (qa, sa), (qb, sb), amax_a, amax_b, a_like, b_like = res
    (qg, sg), (qgt, sgt), amax_g = _rows_both(g, E5M2, margin, hardware.fp8_kernels())
    da = _row_gemm(qg, sg, 2, qb, sb, 2, a_like.dtype)  # [B, M, K]: rows
    db = _row_gemm(qa, sa, 1, qgt, sgt, 1, b_like.dtype)  # [B, K, N]: columns
    return da, db, jnp.stack([amax_a, amax_b, amax_g])


_fp8_bmm_rows.defvjp(_rows_fwd, _rows_bwd)


def as_batched_matrices(dims: Any, lhs: Any, rhs: Any, bmm: Callable[[Any, Any], Any]) -> Any:
    """A dot_general's result made by `bmm` of its operands laid out as batched matrices
    [B, M, K] and [B, K, N] (transposes and reshapes, which XLA folds into the gemm's
    layout), the result laid out as the dot's."""
    (lc, rc), (lb, rb) = dims
    lkept, rkept = _remaining(lhs.ndim, lc, lb), _remaining(rhs.ndim, rc, rb)
    size = lambda x, axes: int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    batch, m, k, n = size(lhs, lb), size(lhs, lkept), size(lhs, lc), size(rhs, rkept)
    a = jnp.transpose(lhs, (*lb, *lkept, *lc)).reshape(batch, m, k)
    b = jnp.transpose(rhs, (*rb, *rc, *rkept)).reshape(batch, k, n)
    shape = [lhs.shape[d] for d in (*lb, *lkept)] + [rhs.shape[d] for d in rkept]
    return bmm(a, b).reshape(shape)


def fp8_dot_rows(dims: Any, pref: Any, margin: int, lhs: Any, rhs: Any, sink: Any) -> Any:
    """fp8_dot_general with per-row current scales (_fp8_bmm_rows of the batched matrices)."""
    return as_batched_matrices(dims, lhs, rhs, lambda a, b: _fp8_bmm_rows(pref, margin, a, b, sink))


def check_scale(scale: Any, what: str) -> None:
    """A concrete scale that is zero, negative or not finite is refused (a traced one is
    what mpjax.fp8 computes: never such, see scale_of)."""
    if isinstance(scale, jax.core.Tracer) or scale is None:
        return
    values = np.asarray(scale, np.float32)
    if values.size and not (np.all(np.isfinite(values)) and np.all(values > 0)):
        raise ValueError(
            f"{what} must be positive and finite, got {values.min()} to {values.max()}: a "
            "scale multiplies the values stored in FP8, so zero or inf loses them. Make the "
            "state with mpjax.fp8.init (scales start at 1 and follow the amaxes), or restore "
            "it from the checkpoint it came from."
        )


# -- MXFP8: E4M3 values in blocks of 32 along each gemm's contraction, power-of-two scales ------

E8M0 = np.dtype(jnp.float8_e8m0fnu)
MX_BLOCK = 32


def mx_quantize(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`x`'s MXFP8 copy for a gemm that contracts its `axis`: the axis moved last, E4M3
    values, and one power-of-two scale per block of 32 consecutive elements along it (OCP
    MX's E8M0): the block's amax / 448 rounded up, so that no value saturates. A block of
    zeros, or one holding an inf or a NaN, has scale 1 (an inf then saturates at 448, as in
    the other recipes; a NaN stays NaN). Returns (values, float32 scales [..., K / 32], the
    amax of x).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.float8.fp8_dot import mx_quantize
      >>> q, s, amax = mx_quantize(jnp.arange(64.0).reshape(1, 64) * 10, axis=1)
      >>> s.tolist(), float(amax)   # 310 / 448 rounds up to 1, 630 / 448 to 2
      ([[1.0, 2.0]], 630.0)
    """
    # Blocks along `axis` where they lie, and the quantized values moved: the one transposed
    # copy is then of one byte an element, not of x (float32 for a master weight).
    axis %= x.ndim
    n = x.shape[axis]
    blocks = x.reshape(*x.shape[:axis], n // MX_BLOCK, MX_BLOCK, *x.shape[axis + 1 :])
    q, bits, amax = mx_blocks(blocks.astype(jnp.float32), axis=axis + 1)
    scale = lax.bitcast_convert_type(jnp.squeeze(bits, axis + 1), jnp.float32)
    return jnp.moveaxis(q.reshape(x.shape), axis, -1), jnp.moveaxis(scale, axis, -1), jnp.max(amax)


Pair = tuple[Any, Any]  # (values, block scales)


def mx_quantize_both(x: jax.Array, kernel: bool) -> tuple[Pair, Pair, jax.Array]:
    """`x` [B, R, C] quantized along C and along R: ((values [B, R, C], scales), (values
    [B, C, R], scales), amax). `kernel` (a GPU that scales blocks) reads x once in one Pallas
    kernel (`quantize_kernel`) where the program runs on one device (see
    hardware.one_device); elsewhere the same numbers from `mx_quantize` twice."""
    if kernel and hardware.one_device():
        return mx_quantize_both_kernel(x)
    q, s, amax = mx_quantize(x, 2)
    qt, st, _ = mx_quantize(x, 1)
    return (q, s), (qt, st), amax


def _mx_gemm(qa: Any, sa: Any, qb: Any, sb: Any, out: Any, cudnn: bool) -> Any:
    """``qa @ qb^T`` of MXFP8 operands [B, M, K] and [B, N, K] with their block scales: on a
    GPU whose tensor cores scale blocks (`cudnn`), ``jax.nn.scaled_matmul`` (cuDNN's
    block-scaled dot); elsewhere the same numbers emulated, the values dequantized into
    bfloat16 (exactly: 3-bit mantissas times powers of two) and multiplied with float32 sums."""
    if cudnn:  # the result written in its own dtype, not in float32 then cast
        return jax.nn.scaled_matmul(
            qa, qb, sa.astype(E8M0), sb.astype(E8M0), preferred_element_type=out
        )

    return emulated_block_gemm(qa, sa, qb, sb, MX_BLOCK).astype(out)


def emulated_block_gemm(qa: Any, sa: Any, qb: Any, sb: Any, block: int) -> Any:
    """``qa @ qb^T`` ([B, M, K] and [B, N, K]) of block-scaled values where no gemm scales
    blocks: each value times its block's scale (exact in bfloat16 for E4M3 or E2M1 values
    and E8M0 or E4M3 scales), in a bfloat16 gemm with float32 sums (the float32 result)."""

    def dequantized(q: Any, s: Any) -> Any:
        blocks = q.reshape(*q.shape[:-1], -1, block).astype(jnp.float32) * s[..., None]
        return blocks.reshape(q.shape).astype(jnp.bfloat16)

    dims = (((2,), (2,)), ((0,), (0,)))
    return lax.dot_general(
        dequantized(qa, sa), dequantized(qb, sb), dims, preferred_element_type=jnp.float32
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mx_bmm(pref: Any, cudnn: bool, a: Any, b: Any, sink: Any) -> Any:
    """``a @ b`` for a [B, M, K] and b [B, K, N] through MXFP8 (all three gemms E4M3)."""
    return _mx_fwd(pref, cudnn, a, b, sink)[0]


def _mx_fwd(pref: Any, cudnn: bool, a: Any, b: Any, sink: Any) -> Any:
    # Each operand is quantized from its high-precision value along the axis each gemm it
    # feeds contracts (a transposed quantized copy is not the same numbers), both at once:
    # the forward gemm takes one copy, and the other is the residual (one byte an element,
    # where the half operand is two) for the weight gradient (a along M) or the input
    # gradient (b along N).
    del sink
    a_k, a_m, amax_a = mx_quantize_both(a, cudnn)  # [B, M, K] and [B, K, M]
    b_n, b_k, amax_b = mx_quantize_both(b, cudnn)  # [B, K, N] and [B, N, K]
    out = _mx_gemm(*a_k, *b_k, pref, cudnn)
    dtypes = (jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))  # the cotangents' dtypes
    return out, (a_m, b_n, amax_a, amax_b, dtypes)


def _mx_bwd(pref: Any, cudnn: bool, res: Any, g: Any) -> Any:
    (qa, sa), (qb, sb), amax_a, amax_b, (a_dtype, b_dtype) = res  # a along M, b along N
    (qg, sg), (qgt, sgt), amax_g = mx_quantize_both(g, cudnn)  # [B, M, N] and [B, N, M]
    # each gradient written in the compute dtype, then in its operand's (see _cotangent)
    da = _cotangent(_mx_gemm(qg, sg, qb, sb, pref, cudnn), a_dtype)  # [B, M, K]
    db = _cotangent(_mx_gemm(qa, sa, qgt, sgt, pref, cudnn), b_dtype)  # [B, K, N]
    return da, db, jnp.stack([amax_a, amax_b, amax_g])


_mx_bmm.defvjp(_mx_fwd, _mx_bwd)


def _cotangent(g: Any, like: Any) -> Any:
    """A block recipe's operand gradient `g`, written in the compute dtype, in the dtype of
    its operand (`like`'s): a float32 master weight's gradient is the half one cast up, as
    when the site's cast to half sat outside the custom derivative (XLA fuses the convert
    into the gradient's consumer)."""
    return g.astype(like.dtype)


def blocks_divide(block: int, m: int, k: int, n: int) -> bool:
    """Whether a gemm's sizes divide into a block recipe's blocks along the contractions its
    three gemms make: K forward, N for the input gradient (and NVFP4's 16 x 16 weight tiles);
    M (the rows: tokens, the batch), which the weight gradient contracts, is padded with zero
    rows instead (see `_rows_padded`), so a site does not come and go with the batch size."""
    return m > 0 and all(d > 0 and d % block == 0 for d in (k, n))


def _rows_padded(block: int, bmm: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """`bmm` of a [B, M, K] with M padded by zero rows to a multiple of `block`, the result's
    padding cut off. Exact: a zero row adds nothing to the weight gradient's sums and does
    not change any block's amax (a partial block is quantized as if it stood alone)."""

    def padded(a: Any, b: Any) -> Any:
        m = a.shape[1]
        extra = -m % block
        if not extra:
            return bmm(a, b)
        return bmm(jnp.pad(a, ((0, 0), (0, extra), (0, 0))), b)[:, :m]

    return padded


def fp8_dot_mx(dims: Any, pref: Any, cudnn: bool, lhs: Any, rhs: Any, sink: Any) -> Any:
    """dot_general through MXFP8 (_mx_bmm of the batched matrices)."""
    bmm = _rows_padded(MX_BLOCK, lambda a, b: _mx_bmm(pref, cudnn, a, b, sink))
    return as_batched_matrices(dims, lhs, rhs, bmm)


def dot_sizes(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dims: Any) -> tuple[int, ...]:
    """(M, K, N) of a dot_general: its lhs's free size, contracted size, rhs's free size."""
    (lc, rc), (lb, rb) = dims
    m = int(np.prod([lhs_shape[d] for d in _remaining(len(lhs_shape), lc, lb)], dtype=np.int64))
    k = int(np.prod([lhs_shape[d] for d in lc], dtype=np.int64))
    n = int(np.prod([rhs_shape[d] for d in _remaining(len(rhs_shape), rc, rb)], dtype=np.int64))
    return m, k, n


# -- NVFP4: E2M1 values in blocks of 16, E4M3 block scales under a float32 tensor scale -------


def _uniform(x: jax.Array, seed: int) -> jax.Array:
    """Noise in [0, 1) per element of float32 `x`: a hash of the element's bits, its position
    and `seed` (counter-based, as Philox is: the same tensor and seed give the same noise, so a
    step replays exactly; elementwise, so it fuses into the quantizing kernel)."""
    index = lax.iota(jnp.uint32, x.size).reshape(x.shape)
    return hash_uniform(lax.bitcast_convert_type(x, jnp.uint32), index, seed)


def _round_e2m1(y: jax.Array, seed: int | None) -> jax.Array:
    """`y` (|y| <= 6) onto E2M1's grid (0, 0.5, 1, 1.5, 2, 3, 4, 6): to nearest even, or, given
    a `seed`, stochastically (up with probability the distance from the grid point below)."""
    noise = None if seed is None else _uniform(y, seed)
    return (jnp.sign(y) * e2m1_magnitude(jnp.abs(y), noise)).astype(E2M1)


def nv_quantize(
    x: jax.Array, axis: int, scale: jax.Array, *, square: bool = False, seed: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """`x`'s NVFP4 copy for a gemm that contracts its `axis`: the axis moved last, E2M1 values
    and one E4M3 scale (returned as float32) per block of 16 consecutive elements along it,
    the block's amax / 6 in units of the float32 tensor `scale` (:func:`nv_tensor_scale`).
    `square` scales 16 x 16 tiles of the last two axes instead, so that the copy contracted
    along either axis holds the same numbers (NVIDIA's recipe, for weights). `seed` rounds
    stochastically (the recipe's gradients). ``values * scales * scale`` is the dequantized x.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.float8.fp8_dot import nv_quantize
      >>> q, s = nv_quantize(jnp.arange(16.0).reshape(1, 16), axis=1, scale=jnp.float32(1.0))
      >>> s.tolist(), q.astype(jnp.float32)[0, -4:].tolist()   # 15 / 6 = 2.5 (E4M3); 12 / 2.5 -> 4
      ([[2.5]], [4.0, 6.0, 6.0, 6.0])
    """
    # times the reciprocal, written out: the kernel's arithmetic (quantize_kernel._nv_kernel)
    moved = jnp.moveaxis(x, axis, -1).astype(jnp.float32) * (1.0 / scale)
    *lead, k = moved.shape
    blocks = moved.reshape(*lead, k // NV_BLOCK, NV_BLOCK)
    if square:  # the amax of each 16 x 16 tile, for each of its 16 rows
        tiles = blocks.reshape(*lead[:-1], lead[-1] // NV_BLOCK, NV_BLOCK, k // NV_BLOCK, NV_BLOCK)
        amax = jnp.max(jnp.abs(tiles), axis=(-3, -1), keepdims=True)
        amax = jnp.broadcast_to(amax, tiles.shape[:-1] + (1,)).reshape(*lead, k // NV_BLOCK, 1)
    else:
        amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    y, block_scale = nv_blocks(blocks, amax)
    return _round_e2m1(y, seed).reshape(moved.shape), block_scale.astype(jnp.float32)[..., 0]


def hadamard_signs(seed: int) -> np.ndarray:
    """The random signs of the recipe's Hadamard transform, fixed by `seed`."""
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), NV_BLOCK)


def _negated(seed: int) -> int:
    """The Hadamard transform's random column signs (`hadamard_signs`) as a bit mask."""
    return sum(1 << j for j, sign in enumerate(hadamard_signs(seed)) if sign < 0)


def _hadamard(seed: int) -> jax.Array:
    """``H diag(signs) / 4``: the 16 x 16 Sylvester Hadamard matrix with random column signs
    (fixed by `seed`), orthonormal (see quantize_kernel.hadamard)."""
    return hadamard(_negated(seed))


def rht(x: jax.Array, seed: int) -> jax.Array:
    """`x` [B, M, ...] with each block of 16 along M rotated by the random Hadamard transform
    ``H diag(signs) / 4`` (H the 16 x 16 Sylvester matrix: orthonormal). A weight gradient
    contracts M, and ``rht(a)^T rht(g) = a^T g``, while the rotation spreads each block's
    outliers over it before it is rounded. Written as a product and a sum over each block
    (elementwise work and a small reduction that fuse into the quantizing kernel; as a gemm
    or as butterfly stages XLA writes the rotated tensor out: 1.05 and 1.34x the step's
    modeled time on a B200). No element of it exceeds 4 x amax(x).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.float8.fp8_dot import rht
      >>> a, g = jnp.arange(32.0).reshape(1, 16, 2), jnp.ones((1, 16, 3))
      >>> bool(jnp.allclose(rht(a, 0)[0].T @ rht(g, 0)[0], a[0].T @ g[0]))
      True
    """
    b, m = x.shape[:2]
    rest = x.shape[2:]
    blocks = x.astype(jnp.float32).reshape(b, m // NV_BLOCK, 1, NV_BLOCK, *rest)
    h = _hadamard(seed).reshape(NV_BLOCK, NV_BLOCK, *(1,) * len(rest))
    return jnp.sum(blocks * h, axis=3).reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class NVOptions:
    """What an NVFP4 gemm site does (static): the recipe's switches and the site's seed."""

    hadamard: bool
    stochastic: bool
    square: bool
    seed: int


def _nv_gemm(a: tuple[Any, ...], b: tuple[Any, ...], out: Any, cudnn: bool) -> Any:
    """``qa @ qb^T`` of NVFP4 operands (values [B, M, K] and [B, N, K], block scales, tensor
    scale): cuDNN's block-scaled dot on compute capability 10, else emulated (the values
    times their block scales, exact in bfloat16, in a bfloat16 gemm with float32 sums). The
    gemm writes bfloat16 for a bfloat16 result (half the bytes of float32; its range is
    float32's, so the unscaled sums cannot overflow it), float32 otherwise; the two tensor
    scales then multiply it, where XLA fuses them into the result's consumer."""
    (qa, sa, ta), (qb, sb, tb) = a, b
    written = jnp.bfloat16 if np.dtype(out) == jnp.bfloat16 else jnp.float32
    if cudnn:
        acc = jax.nn.scaled_matmul(
            qa, qb, sa.astype(E4M3), sb.astype(E4M3), preferred_element_type=written
        )
    else:
        acc = emulated_block_gemm(qa, sa, qb, sb, NV_BLOCK).astype(written)
    return (acc.astype(jnp.float32) * (ta * tb)).astype(out)


def nv_quantize_both(
    x: jax.Array,
    amax: jax.Array,
    kernel: bool,
    opts: NVOptions,
    *,
    weight: bool,
    seeds: Any,
    interpret: bool = False,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """`x` [B, R, C] (its amax given) quantized to NVFP4 along C and along R, the second copy
    rotated along R first where the recipe rotates a weight gradient's operands (not a
    weight's): ((values [B, R, C], block scales, tensor scale), (values [B, C, R], block
    scales, tensor scale)). `kernel` (a GPU that scales blocks) reads x once in one Pallas
    kernel (`quantize_kernel`; `interpret` runs it anywhere, for tests); elsewhere the same
    numbers from `nv_quantize`. A weight is scaled in 16 x 16 tiles where the recipe says
    so, and its two copies are then the same numbers."""
    square = weight and opts.square
    rotate = opts.hadamard and not weight
    if kernel and hardware.one_device():  # the kernel writes the tensor scales too
        negated = _negated(opts.seed) if rotate else None
        return nv_quantize_both_kernel(
            x, amax, negated, square=square, seeds=seeds, interpret=interpret
        )
    scale = nv_tensor_scale(amax)
    # a rotation's tensor scale from 4 x the known amax (no element of it exceeds that):
    # E4M3 block scales keep their 3 bits over the 2 bits of range this gives up, and no pass
    # over the rotated tensor is spent on its exact amax
    scale_t = nv_tensor_scale(4 * amax) if rotate else scale
    if square:  # one quantizing: the copy along R is the one along C transposed
        tiled = (*nv_quantize(x, 1, scale, square=True), scale)
        return _transposed(tiled), tiled
    rows = nv_quantize(x, 2, scale, seed=seeds[0])
    x_t = rht(x, opts.seed) if rotate else x
    return (*rows, scale), (*nv_quantize(x_t, 1, scale_t, seed=seeds[1]), scale_t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _nv_bmm(pref: Any, cudnn: bool, opts: NVOptions, a: Any, b: Any, sink: Any) -> Any:
    """``a @ b`` for a [B, M, K] and b [B, K, N] through NVFP4 (all three gemms E2M1)."""
    return _nv_fwd(pref, cudnn, opts, a, b, sink)[0]


def _nv_fwd(pref: Any, cudnn: bool, opts: NVOptions, a: Any, b: Any, sink: Any) -> Any:
    # Both copies of each operand at once, as MXFP8's: the forward gemm takes one, the other
    # is the residual (half a byte an element) for the gradient gemm that contracts the
    # other axis. The weight's tiles are square by default, so its copies are one quantizing.
    del sink
    amax_a, amax_b = _amax(a), _amax(b)
    no_noise = (None, None)
    a_k, a_m = nv_quantize_both(a, amax_a, cudnn, opts, weight=False, seeds=no_noise)
    b_n, b_k = nv_quantize_both(b, amax_b, cudnn, opts, weight=True, seeds=no_noise)
    out = _nv_gemm(a_k, b_k, pref, cudnn)
    dtypes = (jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))  # the cotangents' dtypes
    return out, (a_m, b_n, amax_a, amax_b, dtypes)


def _transposed(q: tuple[Any, ...]) -> tuple[Any, ...]:
    """A square-tiled copy [B, N, K] as the one contracted along N, [B, K, N]: the same values
    and tile scales."""
    values, scales, scale = q
    tiles = scales[:, ::NV_BLOCK, :]  # [B, N / 16, K / 16]: one row per tile
    return (
        jnp.swapaxes(values, 1, 2),
        jnp.repeat(jnp.swapaxes(tiles, 1, 2), NV_BLOCK, axis=1),
        scale,
    )


def _nv_bwd(pref: Any, cudnn: bool, opts: NVOptions, res: Any, g: Any) -> Any:
    a_m, b_n, amax_a, amax_b, (a_dtype, b_dtype) = res
    seeds = (opts.seed * 2, opts.seed * 2 + 1) if opts.stochastic else (None, None)
    amax_g = _amax(g)
    g_n, g_m = nv_quantize_both(g, amax_g, cudnn, opts, weight=False, seeds=seeds)
    da = _cotangent(_nv_gemm(g_n, b_n, pref, cudnn), a_dtype)  # [B, M, K]
    db = _cotangent(_nv_gemm(a_m, g_m, pref, cudnn), b_dtype)  # [B, K, N], rotated along M
    return da, db, jnp.stack([amax_a, amax_b, amax_g])


_nv_bmm.defvjp(_nv_fwd, _nv_bwd)


def fp8_dot_nv(
    dims: Any, pref: Any, cudnn: bool, opts: NVOptions, lhs: Any, rhs: Any, sink: Any
) -> Any:
    """dot_general through NVFP4 (_nv_bmm of the batched matrices)."""
    bmm = _rows_padded(NV_BLOCK, lambda a, b: _nv_bmm(pref, cudnn, opts, a, b, sink))
    return as_batched_matrices(dims, lhs, rhs, bmm)
