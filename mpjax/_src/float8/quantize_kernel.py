"""MXFP8's quantization of a gemm operand in one GPU kernel (Pallas, on Triton): the operand
read once and written in both orientations a train step needs, each with its own blocks.

A linear layer's input feeds the forward gemm (contracted along its features) and the weight
gradient's (contracted along its rows); the weight feeds the forward gemm and the input
gradient's; the output gradient feeds both gradient gemms. The recipe quantizes each from the
high-precision value along the axis each gemm contracts. XLA writes that as one amax
reduction per orientation, a transposed copy and a convert (1.7 to 2.3x the bytes of the one
pass here, in the B200 program), because it fuses no reduction with a consumer of its result.
This kernel reads a tile once and writes the tile quantized along its rows, its transpose
quantized along the original columns, and both sets of E8M0 scales.

Only a GPU whose tensor cores scale blocks runs it (there the block-scaled gemms are cuDNN's,
see ``fp8_dot._mx_gemm``); the emulation elsewhere quantizes with ``fp8_dot.mx_quantize``, the
same numbers, which ``interpret=True`` checks on any machine.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3 = np.dtype(jnp.float8_e4m3fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)
BLOCK = 32
_TILES = (128, 64, 32)  # a tile's side: the largest of these that divides the axis


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


def _quantized(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """E4M3 values and the biased E8M0 exponents (uint8) of float32 `blocks` [..., n, 32]."""
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    bits = e8m0_exponent_bits(amax)
    scale = lax.bitcast_convert_type(bits, jnp.float32)
    q = jnp.clip(blocks / scale, -448.0, 448.0).astype(E4M3)
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


def _tile(n: int) -> int:
    for t in _TILES:
        if n % t == 0:
            return t
    raise ValueError(f"an MXFP8 operand's axes must be multiples of {BLOCK}, got {n}")


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

    def spec(shape: tuple[int, int], transposed: bool = False) -> Any:
        if transposed:
            return pl.BlockSpec((1, *shape), lambda n, i, j: (n, j, i))
        return pl.BlockSpec((1, *shape), lambda n, i, j: (n, i, j))

    rows, row_scales, cols, col_scales, amaxes = pl.pallas_call(
        _kernel,
        grid=grid,
        in_specs=[spec((tr, tc))],
        out_specs=[
            spec((tr, tc)),
            spec((tr, tc // BLOCK)),
            spec((tc, tr), transposed=True),
            spec((tc, tr // BLOCK), transposed=True),
            spec((1, 1)),
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
