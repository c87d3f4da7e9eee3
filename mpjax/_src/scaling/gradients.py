"""Gradients across devices and micro-batches: `all_reduce_gradients` (the mean over a mapped
axis, in the policy's reduce dtype) and `accumulate_gradients` (micro-batch accumulation)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from mpjax._src.dtypes import is_inexact


def all_reduce_gradients(
    axis_name: str | tuple[str, ...], *, dtype: DTypeLike = jnp.float32, mean: bool = True
) -> optax.GradientTransformation:
    """All-reduces gradients over a ``pmap``/``shard_map`` axis, in `dtype` (float32).

    Half gradients are cast to `dtype`, summed (or averaged) across replicas, and cast back,
    so the cross-replica sum cannot overflow or lose precision in half (jax#27496). Put it
    first in the chain, so the finite check that follows is global:
    ``optax.chain(mpjax.all_reduce_gradients("data"), mpjax.loss_scale(), optax.sgd(0.1))``.

    Under ``jax.jit`` with sharded arrays XLA inserts the reduction itself, in the gradient's
    dtype; use ``shard_map`` with this transformation to control it.

    Args:
      axis_name: the mapped axis (or axes) to reduce over.
      dtype: the dtype to reduce in; None keeps each gradient's dtype.
      mean: average (default) rather than sum.

    Returns:
      A stateless optax ``GradientTransformation``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, mpjax
      >>> tx = optax.chain(mpjax.all_reduce_gradients("i"), optax.sgd(1.0))
      >>> grads = {"w": jnp.arange(2.0, dtype=jnp.float16)[:, None]}
      >>> jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="i")(grads)["w"]
      Array([[-0.5],
             [-0.5]], dtype=float16)
    """

    def reduce(g: Any) -> Any:
        if not is_inexact(g):
            return g
        wide = g if dtype is None else g.astype(dtype)
        out = jax.lax.pmean(wide, axis_name) if mean else jax.lax.psum(wide, axis_name)
        return out.astype(g.dtype)

    def update(
        updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.OptState]:
        del params
        return jax.tree_util.tree_map(reduce, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def accumulate_gradients(
    grad_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    num_microbatches: int,
    *,
    dtype: DTypeLike = jnp.float32,
    mean: bool = True,
) -> Any:
    """Gradients of a batch computed over `num_microbatches` slices and summed in `dtype`.

    ``grad_fn(params, microbatch)`` returns a gradient tree; this runs it on each slice in a
    ``lax.scan`` (one microbatch's activations live at a time) and adds the results in
    `dtype`, float32 by default: half gradients (O3, or half params) would round at every add
    and can overflow in the sum though each microbatch's is finite. The total, averaged over
    the microbatches when `mean`, comes back in each gradient's own dtype, for the optimizer.

    Microbatch ``i`` is rows ``i, i + k, i + 2k, ...`` of every leaf's leading axis (``k`` =
    `num_microbatches`): each microbatch keeps the batch's sharding over that axis, so under
    data parallelism every device works on every microbatch.

    A non-finite gradient in any microbatch makes the total non-finite (an inf or NaN stays
    one through the sum), so ``mpjax.loss_scale`` skips the whole step exactly, as it would
    a step without accumulation. Scale the loss inside `grad_fn`, as usual.

    Args:
      grad_fn: ``(params, microbatch) -> gradients``, e.g. ``jax.grad(loss_fn)``.
      params: passed to every call.
      batch: a tree whose leaves share a leading axis divisible by `num_microbatches`.
      num_microbatches: how many slices (1 runs `grad_fn` once on the whole batch).
      dtype: the floating dtype to sum in; None sums in each gradient's own dtype.
      mean: average over the microbatches (default), as the full batch's mean loss would.

    Returns:
      The gradient tree, in the dtypes `grad_fn` returns.

    Raises:
      ValueError: for a leading axis `num_microbatches` does not divide, a count below 1, or
        a dtype that is not floating.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.ones((8, 2)), "y": jnp.zeros((8,))}
      >>> g = mpjax.accumulate_gradients(jax.grad(loss), jnp.ones(2), batch, 4)
      >>> g, jax.grad(loss)(jnp.ones(2), batch)
      (Array([4., 4.], dtype=float32), Array([4., 4.], dtype=float32))
    """
    k = num_microbatches
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {k!r}.")
    if dtype is not None:
        dtype = np.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"accumulate_gradients sums in dtype={dtype}, which is not floating; pass "
                "jnp.float32 (the default) or None for the gradients' own dtype."
            )
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise ValueError("accumulate_gradients: the batch has no arrays to split.")
    for leaf in leaves:
        n = np.shape(leaf)[0] if np.ndim(leaf) else None
        if n is None or n % k:
            raise ValueError(
                f"accumulate_gradients: a batch leaf of shape {np.shape(leaf)} cannot be split "
                f"into {k} microbatches along its leading axis; use a batch size that "
                f"{k} divides, or another num_microbatches."
            )

    def split(x: Any) -> Any:  # rows i, i+k, ...: microbatch i keeps the batch axis's sharding
        x = jnp.asarray(x)
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    micro = jax.tree_util.tree_map(split, batch)
    first = jax.tree_util.tree_map(lambda x: x[0], micro)
    shapes = jax.eval_shape(grad_fn, params, first)

    def acc_dtype(s: Any) -> Any:
        float_leaf = jnp.issubdtype(s.dtype, jnp.floating)
        return dtype if dtype is not None and float_leaf else s.dtype

    init = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, acc_dtype(s)), shapes)

    def body(acc: Any, mb: Any) -> tuple[Any, None]:
        g = grad_fn(params, mb)
        return jax.tree_util.tree_map(lambda a, x: a + x.astype(a.dtype), acc, g), None

    total, _ = jax.lax.scan(body, init, micro)

    def finish(a: Any, s: Any) -> Any:
        if mean and jnp.issubdtype(a.dtype, jnp.floating):
            a = a / k
        return a.astype(s.dtype)

    return jax.tree_util.tree_map(finish, total, shapes)
