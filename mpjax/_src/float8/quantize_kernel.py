"""The block recipes' quantization of a gemm operand in one GPU kernel (Pallas, on Triton): the
operand read once and written in both orientations a train step needs, each with its own
blocks.

A linear layer's input feeds the forward gemm (contracted along its features) and the weight
gradient's (contracted along its rows); the weight feeds the forward gemm and the input
gradient's; the output gradient feeds both gradient gemms. The recipes quantize each from the
high-precision value along the axis each gemm contracts. XLA writes that as one amax
reduction per orientation, a transposed copy and a convert (1.7 to 2.3x the bytes of the one
pass here, in the B200 program), because it fuses no reduction with a consumer of its result.
These kernels read a tile once and write the tile quantized along its rows, its transpose
quantized along the original columns, and both sets of scales: MXFP8 (E4M3 values, E8M0
scales per 32) and NVFP4 (E2M1 values two to a byte, E4M3 scales per 16 under a float32
tensor scale; the second copy optionally rotated by the Hadamard transform, either copy
optionally rounded stochastically).

Only a GPU whose tensor cores scale blocks runs them (there the block-scaled gemms are
cuDNN's, see ``fp8_dot``); the emulation elsewhere quantizes with ``fp8_dot.mx_quantize`` and
``fp8_dot.nv_quantize``, the same numbers, which ``interpret=True`` checks on any machine.
The elementwise rules both share (E8M0 rounding, E2M1 rounding, the noise) live here.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3 = np.dtype(jnp.float8_e4m3fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)
BLOCK = 32
_TILES = (128, 64, 32, 16)  # a tile's side: the largest of these that divides the axis


def e8m0_exponent_bits(amax: jax.Array) -> jax.Array:
    """The power of two at or above ``amax / 448`` as float32 bits (int32), OCP MX's rounded-up
    E8M0 scale, exactly: adding a mantissa's worth of ones before cutting the mantissa off
    rounds up every value that is not already a power of two (``ceil(log2(.))`` in float32
    rounds some powers of two up one more). A block of zeros, or one holding an inf or a
    NaN, gets scale 1. ``amax`` is float32."""
    usable = (amax > 0) & (amax < jnp.inf)
    wanted = jnp.where(usable, amax, 1.0) / np.float32(448.0)
    bits = lax.bitcast_convert_type(wanted, jnp.int32)
    up = (bits + np.int32(0x7FFFFF)) & np.int32(-0x800000)  # sign 0, exponent, mantissa 0
    # E8M0 spans 2**-127 to 2**127: a float32 exponent field (1 to 254) fits it as it is,
    # and a subnormal quotient (field 0) rounds up to the smallest normal, 2**-126
    up = jnp.maximum(up, np.int32(0x800000))
    return jnp.where(usable, up, np.int32(0x3F800000))


def hash_uniform(bits: jax.Array, index: jax.Array, seed: int) -> jax.Array:
    """Noise in [0, 1): a hash of each element's float32 `bits` and `index` (uint32) and
    `seed`, lowbias32's finalizer (counter-based: the same tensor and seed give the same noise,
    so a step replays exactly)."""
    h = bits ^ (index * np.uint32(0x9E3779B1))
    h = h ^ np.uint32((seed * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF)
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        h = (h ^ (h >> np.uint32(shift))) * np.uint32(mul)
    h = h ^ (h >> np.uint32(16))
    return (h >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)


def e2m1_magnitude(a: jax.Array, noise: jax.Array | None) -> jax.Array:
    """`a` (0 <= a <= 6, float32) onto E2M1's grid (0, 0.5, 1, 1.5, 2, 3, 4, 6): to nearest,
    ties to the even code, or, given `noise` in [0, 1), up with probability the distance from
    the grid point below (stochastic rounding). Arithmetic only (floor and selects), so a
    GPU kernel and XLA's program round alike."""
    step = jnp.where(a < 2, 0.5, jnp.where(a < 4, 1.0, 2.0))
    q = a / step  # exact: a power of two
    below = jnp.floor(q)
    frac = q - below
    if noise is None:  # a tie goes to the even multiple of the step: the even code
        odd = below - 2 * jnp.floor(below / 2)
        up = (frac > 0.5) | ((frac == 0.5) & (odd == 1))
    else:
        up = noise < frac
    return jnp.minimum(jnp.where(up, below + 1, below) * step, 6.0)


def mx_blocks(blocks: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """MXFP8's rule for float32 `blocks` [..., n, 32] (the 32 along `axis`): (E4M3 values,
    each block's scale as float32 bits [..., n, 1] (see e8m0_exponent_bits), each block's
    amax [..., n, 1]); the values are the blocks over their scale, saturating. The kernel and
    XLA's program (``fp8_dot.mx_quantize``) both quantize with it."""
    amax = jnp.max(jnp.abs(blocks), axis=axis, keepdims=True)
    bits = e8m0_exponent_bits(amax)
    scale = lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.clip(blocks / scale, -448.0, 448.0).astype(E4M3), bits, amax


def _quantized(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """E4M3 values and the biased E8M0 exponents (uint8) of float32 `blocks` [..., n, 32]."""
    q, bits, _ = mx_blocks(blocks)
    return q, (bits >> 23).astype(jnp.uint8)[..., 0]


def _kernel(
    x_ref: Any,
    rows_ref: Any,
    row_scales_ref: Any,
    cols_ref: Any,
    col_scales_ref: Any,
    amax_ref: Any,
) -> None:
    x = x_ref[0].astype(jnp.float32)  # [tile r, tile c]
    r, c = x.shape
    q, s = _quantized(x.reshape(r, c // BLOCK, BLOCK))
    rows_ref[0] = q.reshape(r, c)
    row_scales_ref[0] = s
    q, s = _quantized(x.T.reshape(c, r // BLOCK, BLOCK))
    cols_ref[0] = q.reshape(c, r)
    col_scales_ref[0] = s
    amax_ref[0] = jnp.max(jnp.abs(x), axis=(0, 1), keepdims=True)


def _spec(shape: tuple[int, int], transposed: bool = False) -> Any:
    """A [1, *shape] block of a [B, R, C] array on the (batch, row tile, column tile) grid;
    `transposed`: of a [B, C, R] array, at the transposed tile."""
    from jax.experimental import pallas as pl

    if transposed:
        return pl.BlockSpec((1, *shape), lambda n, i, j: (n, j, i))
    return pl.BlockSpec((1, *shape), lambda n, i, j: (n, i, j))


def tiles_fit(*sizes: int) -> bool:
    """Whether each of `sizes` (an operand's rows and columns) divides into the kernels'
    smallest tile (16)."""
    return all(n % _TILES[-1] == 0 for n in sizes)


def _tile(n: int, smallest: int = BLOCK) -> int:
    for t in _TILES:
        if t >= smallest and n % t == 0:
            return t
    raise ValueError(f"a block-scaled operand's axes must be multiples of {smallest}, got {n}")


def _compiler_params() -> Any:
    from jax.experimental.pallas import triton as pltriton

    # JAX 0.6 names it TritonCompilerParams
    params: Any = getattr(pltriton, "CompilerParams", None)
    if params is None:
        params = pltriton.TritonCompilerParams  # type: ignore[attr-defined]
    return params(num_warps=4, num_stages=1)


@functools.partial(jax.jit, static_argnames="interpret")
def mx_quantize_both(
    x: jax.Array, *, interpret: bool = False
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array], jax.Array]:
    """`x` [B, R, C] quantized to MXFP8 along C and along R in one kernel: ((values [B, R, C],
    E8M0 scales [B, R, C / 32]), (values [B, C, R] (x's transpose), scales [B, C, R / 32]),
    the amax of x). The numbers of ``fp8_dot.mx_quantize(x, 2)`` and ``mx_quantize(x, 1)``.
    `interpret` runs the kernel on any backend (Pallas's interpreter), for tests.

    A function of its own (``jax.jit``): it lowers the same wherever it is called, so XLA
    merges the quantizations of one tensor that several gemms take (a block's query, key
    and value projections read one normalized input), which the name stack in each
    call's Pallas kernel otherwise tells apart."""
    from jax.experimental import pallas as pl

    b, r, c = x.shape
    tr, tc = _tile(r), _tile(c)
    grid = (b, r // tr, c // tc)

    rows, row_scales, cols, col_scales, amaxes = pl.pallas_call(
        _kernel,
        grid=grid,
        in_specs=[_spec((tr, tc))],
        out_specs=[
            _spec((tr, tc)),
            _spec((tr, tc // BLOCK)),
            _spec((tc, tr), transposed=True),
            _spec((tc, tr // BLOCK), transposed=True),
            _spec((1, 1)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, r, c), E4M3),
            jax.ShapeDtypeStruct((b, r, c // BLOCK), jnp.uint8),
            jax.ShapeDtypeStruct((b, c, r), E4M3),
            jax.ShapeDtypeStruct((b, c, r // BLOCK), jnp.uint8),
            jax.ShapeDtypeStruct((b, r // tr, c // tc), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(),
        name="mx_quantize_both",
    )(x)
    as_e8m0 = lambda s: lax.bitcast_convert_type(s, E8M0)  # the same bits
    return (rows, as_e8m0(row_scales)), (cols, as_e8m0(col_scales)), jnp.max(amaxes)


# -- NVFP4: E2M1 values in blocks of 16 under E4M3 block scales and a float32 tensor scale ------

E2M1 = np.dtype(jnp.float4_e2m1fn)
NV_BLOCK = 16


def nv_tensor_scale(amax: jax.Array) -> jax.Array:
    """NVFP4's float32 tensor scale: the tensor's amax / (6 x 448), so that every block's scale
    (its amax / 6, in tensor-scale units) fits E4M3. 1 for a tensor of zeros or one holding an
    inf or a NaN."""
    amax = jnp.asarray(amax, jnp.float32)
    usable = (amax > 0) & (amax < jnp.inf)
    return jnp.where(usable, amax / np.float32(6.0 * 448.0), np.float32(1.0))


def nv_blocks(blocks: jax.Array, amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4's rule for `blocks` [..., n, 16] (in tensor-scale units) whose amaxes are `amax`
    [..., n, 1]: (the values over their block's E4M3 scale, clipped to E2M1's range and not
    yet rounded; the scales, amax / 6 in E4M3). The kernel and XLA's program
    (``fp8_dot.nv_quantize``) both quantize with it."""
    scale = jnp.clip(amax / 6.0, 0, 448.0).astype(E4M3)
    divisor = scale.astype(jnp.float32)
    divisor = jnp.where(divisor > 0, divisor, 1.0)
    return jnp.clip(blocks / divisor, -6.0, 6.0), scale


def _e2m1_codes(y: jax.Array, noise: jax.Array | None) -> jax.Array:
    """E2M1's 4-bit codes (int32) of `y` (|y| <= 6): sign bit 8, then the magnitude's index
    on the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    m = e2m1_magnitude(jnp.abs(y), noise)
    code = jnp.where(m < 2, 2 * m, jnp.where(m < 4, m + 2, m / 2 + 4)).astype(jnp.int32)
    return code + 8 * (y < 0).astype(jnp.int32)


def _packed(codes: jax.Array) -> jax.Array:
    """Codes [r, c] two to a byte, the first in the low nibble ([r, c / 2] uint8): the layout
    of a float4 array, so a bitcast makes it one."""
    r, c = codes.shape
    low, high = jnp.split(codes.reshape(r, c // 2, 2), 2, axis=-1)
    return (low | (high << 4)).reshape(r, c // 2).astype(jnp.uint8)


def _nv_blocks(
    y: jax.Array, amax: jax.Array, seed: int | None, first: Any, width: int
) -> tuple[jax.Array, jax.Array]:
    """Packed E2M1 values and E4M3 block scales of `y` [r, c] (in tensor-scale units), its
    blocks [r, c / 16] having `amax` [r, c / 16, 1] (the scale: amax / 6); rounded
    stochastically with `seed`, `y` being a tile of a tensor whose rows are `width` long,
    its first element at flat position `first` (see _noise)."""
    r, c = y.shape
    v, scale = nv_blocks(y.reshape(r, c // NV_BLOCK, NV_BLOCK), amax)
    v = v.reshape(r, c)
    codes = _e2m1_codes(v, _noise(v, seed, first, width))
    return _packed(codes), scale.reshape(r, c // NV_BLOCK)


def _block_amax(y: jax.Array) -> jax.Array:
    r, c = y.shape
    return jnp.max(jnp.abs(y.reshape(r, c // NV_BLOCK, NV_BLOCK)), axis=-1, keepdims=True)


def _tile_amax(y: jax.Array) -> jax.Array:
    """The amax of each 16 x 16 tile of `y` [r, c], for each row's block: [r, c / 16, 1]."""
    r, c = y.shape
    tiles = jnp.abs(y.reshape(r // NV_BLOCK, NV_BLOCK, c // NV_BLOCK, NV_BLOCK))
    amax = jnp.max(jnp.max(tiles, axis=3), axis=1, keepdims=True)  # [r / 16, 1, c / 16]
    amax = jnp.broadcast_to(amax, (r // NV_BLOCK, NV_BLOCK, c // NV_BLOCK))
    return amax.reshape(r, c // NV_BLOCK, 1)


def _noise(y: jax.Array, seed: int | None, first: Any, width: int) -> jax.Array | None:
    """The stochastic rounding noise of `y` [r, c], a tile of a tensor whose rows are `width`
    long, its first element at flat position `first`: what hash_uniform gives the whole."""
    if seed is None:
        return None
    r, c = y.shape
    rows = lax.broadcasted_iota(jnp.int32, (r, c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (r, c), 1)
    index = (first + rows * width + cols).astype(jnp.uint32)
    return hash_uniform(lax.bitcast_convert_type(y, jnp.uint32), index, seed)


def hadamard(negative: int) -> jax.Array:
    """``H diag(signs) / 4`` (float32, 16 x 16, orthonormal): the Sylvester Hadamard matrix
    (``H[i, j]`` is -1 where ``i & j`` has an odd number of bits) with column j negated where
    bit j of `negative` is set. Made of iotas and Python integers, not an array constant, so
    that it is built inside a kernel, and in a remat or scan body that autocast rebuilds
    (which takes no captured constants)."""
    i = lax.broadcasted_iota(jnp.int32, (NV_BLOCK, NV_BLOCK), 0)
    j = lax.broadcasted_iota(jnp.int32, (NV_BLOCK, NV_BLOCK), 1)
    both = i & j
    parity = (both ^ (both >> 1) ^ (both >> 2) ^ (both >> 3)) & 1
    flip = parity ^ ((negative >> j) & 1)
    return jnp.where(flip == 1, np.float32(-0.25), np.float32(0.25))


def _rotated(x: jax.Array, h: jax.Array) -> jax.Array:
    """Each block of 16 along the rows of `x` [r, c] times the Hadamard matrix `h`
    (``rot[i] = sum_j h[i, j] x[j]``), as ``fp8_dot.rht`` rotates."""
    r, c = x.shape
    blocks = x.reshape(r // NV_BLOCK, 1, NV_BLOCK, c)
    return jnp.sum(blocks * h.reshape(1, NV_BLOCK, NV_BLOCK, 1), axis=2).reshape(r, c)


class _NVKernel(NamedTuple):
    """What one NVFP4 quantizing kernel does (static)."""

    square: bool
    hadamard: int | None  # the Hadamard transform's negated columns (see hadamard), or none
    seeds: tuple[int | None, int | None]
    shape: tuple[int, int, int]  # x's: [B, R, C]


def _nv_kernel(
    cfg: _NVKernel,
    x_ref: Any,
    amax_ref: Any,
    rows_ref: Any,
    row_scales_ref: Any,
    cols_ref: Any,
    col_scales_ref: Any,
    tensor_scales_ref: Any,
) -> None:
    from jax.experimental import pallas as pl

    _, rr, cc = cfg.shape
    n, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    x = x_ref[0].astype(jnp.float32)  # [tile r, tile c]
    r, c = x.shape
    amax = amax_ref[0]
    scale = nv_tensor_scale(amax)
    # a rotation's from 4 x the amax (see fp8_dot.nv_quantize_both)
    scale_t = nv_tensor_scale(4 * amax) if cfg.hadamard is not None else scale
    # every program writes the same two tensor scales: the gemms multiply their results by
    # these, values that no kernel of XLA's works out (see fp8_dot._nv_gemm)
    tensor_scales_ref[0] = scale
    tensor_scales_ref[1] = scale_t
    # times the reciprocal, as fp8_dot.nv_quantize: a compiler may or may not rewrite a
    # division by a scalar so, and the two programs would then round differently
    y = x * (1.0 / scale)
    amax = _tile_amax(y) if cfg.square else _block_amax(y)
    first = n * rr * cc + i * r * cc + j * c
    q, s = _nv_blocks(y, amax, cfg.seeds[0], first, cc)
    rows_ref[0] = q
    row_scales_ref[0] = s
    yt = (_rotated(x, hadamard(cfg.hadamard)) if cfg.hadamard is not None else x).T
    yt = yt * (1.0 / scale_t)
    # square: the same numbers, transposed (the tiles' amaxes are the transposed tiles')
    amax = _tile_amax(yt) if cfg.square else _block_amax(yt)
    first = n * rr * cc + j * c * rr + i * r
    q, s = _nv_blocks(yt, amax, cfg.seeds[1], first, rr)
    cols_ref[0] = q
    col_scales_ref[0] = s


def nv_quantize_both(
    x: jax.Array,
    amax: jax.Array,
    negated: int | None,
    *,
    square: bool = False,
    seeds: tuple[int | None, int | None] = (None, None),
    interpret: bool = False,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]:
    """`x` [B, R, C] (its `amax` given, float32) quantized to NVFP4 along C and along R in one
    kernel: ((E2M1 values [B, R, C], E4M3 scales [B, R, C / 16], the float32 tensor scale),
    (values [B, C, R] (x's transpose), scales [B, C, R / 16], its tensor scale)), under the
    tensor scale of `amax` (of 4 x amax for a copy rotated along R by the Hadamard transform
    whose columns `negated` negates (see :func:`hadamard`), where given). The kernel works
    the tensor scales out and writes them, so no kernel of XLA's computes them before it or
    after it (their product, which multiplies each gemm's result, is then of two values XLA
    folds into that multiply: 30 kernels fewer in the FP8 benchmark's B200 step). `square`
    scales 16 x 16 tiles (both copies then hold the same numbers); `seeds` round each copy
    stochastically. The numbers of ``fp8_dot.nv_quantize`` (and ``rht``). `interpret` runs
    it anywhere (for tests)."""
    return _nv_quantize_both(x, amax, negated, square, seeds, interpret)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _nv_quantize_both(
    x: jax.Array,
    amax: jax.Array,
    negated: int | None,
    square: bool,
    seeds: tuple[int | None, int | None],
    interpret: bool,
) -> Any:
    from jax.experimental import pallas as pl

    b, r, c = x.shape
    tr, tc = _tile(r, NV_BLOCK), _tile(c, NV_BLOCK)

    cfg = _NVKernel(square, negated, seeds, (b, r, c))
    kernel = functools.partial(_nv_kernel, cfg)
    rows, row_scales, cols, col_scales, scales = pl.pallas_call(
        kernel,
        grid=(b, r // tr, c // tc),
        in_specs=[
            _spec((tr, tc)),
            pl.BlockSpec((1,), lambda n, i, j: (0,)),
        ],
        out_specs=[
            _spec((tr, tc // 2)),
            _spec((tr, tc // NV_BLOCK)),
            _spec((tc, tr // 2), transposed=True),
            _spec((tc, tr // NV_BLOCK), transposed=True),
            pl.BlockSpec((2,), lambda n, i, j: (0,)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, r, c // 2), jnp.uint8),
            jax.ShapeDtypeStruct((b, r, c // NV_BLOCK), E4M3),
            jax.ShapeDtypeStruct((b, c, r // 2), jnp.uint8),
            jax.ShapeDtypeStruct((b, c, r // NV_BLOCK), E4M3),
            jax.ShapeDtypeStruct((2,), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(),
        name="nv_quantize_both",
    )(x, amax.astype(jnp.float32).reshape(1))

    def unpacked(q: jax.Array) -> jax.Array:  # [B, R, C / 2] bytes -> [B, R, C] float4
        *lead, half = q.shape
        return lax.bitcast_convert_type(q, E2M1).reshape(*lead, 2 * half)

    return (unpacked(rows), row_scales, scales[0]), (unpacked(cols), col_scales, scales[1])


# -- per-row current scaling (Hopper's recipe): each row and each column its own scale ---------


def _rows_kernel(
    q_dtype: Any,
    x_ref: Any,
    row_scale_ref: Any,
    col_scale_ref: Any,
    rows_ref: Any,
    cols_ref: Any,
) -> None:
    lim = float(jnp.finfo(q_dtype).max)
    x = x_ref[0].astype(jnp.float32)  # [tile r, tile c]
    rows_ref[0] = jnp.clip(x * row_scale_ref[0], -lim, lim).astype(q_dtype)
    cols_ref[0] = jnp.clip(x * col_scale_ref[0], -lim, lim).T.astype(q_dtype)


@functools.partial(jax.jit, static_argnames=("q_dtype", "interpret"))
def rows_quantize_both(
    x: jax.Array,
    row_scale: jax.Array,
    col_scale: jax.Array,
    *,
    q_dtype: Any,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`x` [B, R, C] in `q_dtype` (E4M3, E5M2) twice, from one read: each row times its scale
    ([B, R, 1]), as [B, R, C]; and each column times its own ([B, 1, C]), transposed, as
    [B, C, R]. Saturating, as ``fp8_dot.quantize``; its numbers. The scales are the current
    per-row recipe's, from XLA's reductions of x's rows and columns."""
    from jax.experimental import pallas as pl

    b, r, c = x.shape
    tr, tc = _tile(r, NV_BLOCK), _tile(c, NV_BLOCK)
    rows, cols = pl.pallas_call(
        functools.partial(_rows_kernel, np.dtype(q_dtype)),
        grid=(b, r // tr, c // tc),
        in_specs=[
            _spec((tr, tc)),
            pl.BlockSpec((1, tr, 1), lambda n, i, j: (n, i, 0)),
            pl.BlockSpec((1, 1, tc), lambda n, i, j: (n, 0, j)),
        ],
        out_specs=[_spec((tr, tc)), _spec((tc, tr), transposed=True)],
        out_shape=[
            jax.ShapeDtypeStruct((b, r, c), q_dtype),
            jax.ShapeDtypeStruct((b, c, r), q_dtype),
        ],
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(),
        name="rows_quantize_both",
    )(x, row_scale.astype(jnp.float32), col_scale.astype(jnp.float32))
    return rows, cols
