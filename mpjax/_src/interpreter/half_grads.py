"""Custom derivatives that keep a half op's gradient sums in float32: a half lookup whose
cotangent scatter-adds in float32, a half matmul whose float32 operand's gradient comes out
of a matmul that writes float32, and the test for a broadcast that grows a half value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax

from mpjax._src import jax_compat as jc
from mpjax._src.dtypes import is_float_dtype
from mpjax._src.interpreter.rules import n_elements, sums_stay_local


def gather_half(
    params: dict[str, Any], half: np.dtype, x_aval: jc.ShapedArray
) -> Callable[..., jc.Value]:
    """gather(x.astype(half), indices), differentiated as gather(x, indices) then the cast:
    the cotangent goes up to float32 and scatter-adds there, so the rows an embedding lookup
    takes many times sum in float32. `x_aval` is x's type."""
    gather = lambda x, idx: jc.bind(lax.gather_p, [x, idx], params)

    @jax.custom_vjp
    def f(x: jc.Value, idx: jc.Value) -> jc.Value:
        return gather(jc.convert(x, half), idx)

    def fwd(x: jc.Value, idx: jc.Value) -> tuple[jc.Value, jc.Value]:
        return f(x, idx), idx

    def bwd(idx: jc.Value, ct: jc.Value) -> tuple[jc.Value, None]:
        (dx,) = jax.linear_transpose(lambda x: gather(x, idx), x_aval)(ct.astype(x_aval.dtype))
        return dx, None

    f.defvjp(fwd, bwd)
    return f


def gather_summing_wide(params: dict[str, Any]) -> Callable[..., jc.Value]:
    """gather(x, indices) on a half `x`, whose cotangent scatter-adds in float32 and is rounded
    to x's dtype once. JAX's own transpose scatter-adds in x's dtype, one rounding per row
    taken: a row an embedding lookup takes a few hundred times (a frequent token) then sums
    to a fraction of its gradient (in bfloat16, 4096 cotangents of 2.0 sum to 512), where
    torch's embedding backward accumulates in float32. The forward values are the plain
    gather's; the tangent is the gather of the float32 tangent, so forward mode works too."""
    gather = lambda x, idx: jc.bind(lax.gather_p, [x, idx], params)

    @jax.custom_jvp
    def f(x: jc.Value, idx: jc.Value) -> jc.Value:
        return gather(x, idx)

    @f.defjvp
    def f_jvp(
        primals: tuple[jc.Value, ...], tangents: tuple[jc.Value, ...]
    ) -> tuple[jc.Value, jc.Value]:
        x, idx = primals
        t = jc.convert(gather(jc.convert(tangents[0], np.float32), idx), x.dtype)
        return gather(x, idx), t

    return f


def lookup(params: dict[str, Any], x: jc.Value, idx: jc.Value, sum_wide: bool) -> jc.Value:
    """gather(x, idx) with `params`; through gather_summing_wide where `sum_wide` (see
    rules.WideSums.lookups), its transpose would sum repeated rows in half, and that sum stays
    on one device (rules.sums_stay_local)."""
    if sum_wide and sums_repeats(params, x) and sums_stay_local():
        return gather_summing_wide(params)(x, idx)
    return jc.bind(lax.gather_p, [x, idx], params)


def sums_repeats(params: dict[str, Any], x: jc.Value) -> bool:
    """Whether a gather with `params` of `x` transposes to a scatter-add in half that may add
    several cotangents into one element (its indices are not marked unique)."""
    dtype = getattr(x, "dtype", None)
    return (
        dtype is not None
        and is_float_dtype(dtype)
        and np.dtype(dtype).itemsize < 4
        and not params.get("unique_indices", False)
    )


def dot_wide_grads(
    params: dict[str, Any],
    half: np.dtype,
    wide: tuple[bool, ...],
    avals: tuple[jc.ShapedArray, ...],
) -> Callable[..., jc.Value]:
    """dot_general(a, b) in `half`, where the operands `wide` marks are float32 and cast to
    `half` inside; their cotangents come from half matmuls that write float32 (tensor cores
    accumulate in float32 anyway), not from half ones cast up. The residuals are the half
    operands, as the plain half matmul's. `avals` are the operands' types."""
    dims = params["dimension_numbers"]
    a_aval, b_aval = avals
    dot = lambda a, b, out: jc.bind(
        lax.dot_general_p, [a, b], {**params, "preferred_element_type": out}
    )

    @jax.custom_vjp
    def f(a: jc.Value, b: jc.Value) -> jc.Value:
        return dot(jc.convert(a, half), jc.convert(b, half), half)

    def fwd(a: jc.Value, b: jc.Value) -> tuple[jc.Value, tuple[jc.Value, jc.Value]]:
        a_h, b_h = jc.convert(a, half), jc.convert(b, half)
        return dot(a_h, b_h, half), (a_h, b_h)

    def bwd(res: tuple[jc.Value, jc.Value], g: jc.Value) -> tuple[jc.Value, jc.Value]:
        a_h, b_h = res
        _, vjp = jax.vjp(lambda a, b: dot(a, b, half), a_h, b_h)
        da, db = vjp(g)
        if wide[0]:
            da = _dot_transpose_lhs(g, a_aval, b_h, dims, params)
        if wide[1]:
            (a_c, b_c), (a_b, b_b) = dims
            db = _dot_transpose_lhs(g, b_aval, a_h, ((b_c, a_c), (b_b, a_b)), params, swap=True)
        return jc.convert(da, a_aval.dtype), jc.convert(db, b_aval.dtype)

    f.defvjp(fwd, bwd)
    return f


def _dot_transpose_lhs(
    g: jc.Value,
    x_aval: jc.ShapedArray,
    y: jc.Value,
    dims: Any,
    params: dict[str, Any],
    swap: bool = False,
) -> jc.Value:
    """The cotangent of dot_general's left operand (of type `x_aval`), summed in float32 from
    the half `g` and `y`: JAX's own transpose rule (jax/_src/lax/lax.py,
    _dot_general_transpose_lhs, Apache-2.0), with a float32 result."""
    (x_contract, y_contract), (x_batch, y_batch) = dims
    x_kept = [i for i in range(len(x_aval.shape)) if i not in (*x_contract, *x_batch)]
    y_kept = [i for i in range(np.ndim(y)) if i not in (*y_contract, *y_batch)]
    nb = len(x_batch)
    if swap:
        ans_y = list(range(nb, nb + len(y_kept)))
    else:
        ans_y = list(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
    ans_batch = list(range(nb))
    new_dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
    x_contract_by_y = [int(i) for i in np.take(x_contract, np.argsort(y_contract))]
    unsorted = list(x_batch) + x_kept + x_contract_by_y
    out_params = {
        **params,
        "dimension_numbers": new_dims,
        "preferred_element_type": np.dtype(np.float32),
    }
    if "out_sharding" in params:
        out_params["out_sharding"] = jc.permuted_sharding(x_aval, unsorted)
    half_dot = lambda g, y: jc.bind(lax.dot_general_p, [g, y], out_params)
    # XLA's CPU runtime rejects some fused half x half = float32 dots ("Unsupported element
    # type for DotThunk"); there the operands go up to float32 first, exactly (CPUs compute
    # half matmuls in float32 anyway).
    wide_dot = lambda g, y: half_dot(jc.convert(g, np.float32), jc.convert(y, np.float32))
    out = lax.platform_dependent(g, y, cpu=wide_dot, default=half_dot)
    return lax.transpose(out, tuple(int(i) for i in np.argsort(unsorted)))


def grows_half(eqn: jc.JaxprEqn, invals: list[jc.Value]) -> bool:
    """Whether `eqn` broadcasts a half value to more elements."""
    if eqn.primitive.name != "broadcast_in_dim" or n_elements(eqn.outvars[0]) <= n_elements(
        eqn.invars[0]
    ):
        return False
    dtype = getattr(invals[0], "dtype", None)
    return dtype is not None and is_float_dtype(dtype) and np.dtype(dtype).itemsize < 4
