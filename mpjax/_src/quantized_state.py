"""Optimizer moments in 8 bits: blockwise-scaled logarithmic codes, rounded without bias."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpjax._src.half_params import _check_inner, _is_float, _key_and_impl

_F32 = jnp.dtype(jnp.float32)
# The optax state fields that hold moments: signed (momentum-like) and non-negative
# (second-moment-like). Adam, AdamW, Lion, SGD with momentum (trace), Adafactor (v, v_row,
# v_col), Adagrad/RMSProp (sum_of_squares, nu).
FIRST = frozenset({"mu", "trace", "momentum", "ema"})
SECOND = frozenset({"nu", "v", "v_row", "v_col", "sum_of_squares"})
# Codes per octave below a block's largest magnitude: signed codes have 7 bits of magnitude
# (127 values, 126 steps of 2**(1/4): down to 2**-31.5 of the block's largest), non-negative
# ones 8 bits (255 values, steps of 2**(1/8): 2**-31.75). The last code is zero.
_STEPS = {True: 4, False: 8}
_ZERO = {True: 127, False: 255}


class QuantizedMoment:
    """One moment array stored in 8 bits: uint8 codes in blocks, a float32 scale per block.

    A non-negative moment (Adam's second moment) is stored as its square root, so its 8-bit
    codes span 2**-63.5 of a block's largest value. A code ``c`` stands for
    ``scale * 2**(-c / steps)`` (``steps`` = 8, or 4 with a sign bit for signed moments), and
    the last code for zero. The last block is padded with zeros.

    Attributes:
      codes: uint8 ``[blocks, block_size]``.
      scales: float32 ``[blocks]``: each block's largest magnitude.
      shape: the moment's shape.
      dtype: the moment's dtype when dequantized.
      signed: whether the moment can be negative (first moments).

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> m = jnp.array([0.5, -0.25, 0.0, 1e-3])
      >>> q = mpjax.QuantizedMoment.quantize(m, signed=True, block_size=4, key=jax.random.key(0))
      >>> q.codes.dtype, q.scales.tolist(), q.dequantize().tolist()[:3]
      (dtype('uint8'), [0.5], [0.5, -0.25, 0.0])
    """

    def __init__(self, codes: Any, scales: Any, shape: tuple[int, ...], dtype: Any, signed: bool):
        self.codes, self.scales = codes, scales
        self.shape, self.dtype, self.signed = tuple(shape), np.dtype(dtype), bool(signed)

    def __repr__(self) -> str:
        kind = "signed" if self.signed else "sqrt"
        return f"QuantizedMoment({kind}, shape={self.shape}, blocks={np.shape(self.codes)})"

    @classmethod
    def quantize(
        cls, x: jax.Array, *, signed: bool, block_size: int, key: jax.Array
    ) -> QuantizedMoment:
        """Quantizes `x` blockwise, rounding each value to one of its two neighbouring codes
        with the probabilities that make the stored value's expectation exact (the square
        root's, for a non-negative moment).

        Example:
          >>> import jax, jax.numpy as jnp, mpjax
          >>> v = jnp.full(256, 3e-7)
          >>> keys = jax.random.split(jax.random.key(0), 2000)
          >>> q = jax.vmap(lambda k: mpjax.QuantizedMoment.quantize(
          ...     v.at[0].set(1.0), signed=False, block_size=256, key=k).dequantize())(keys)
          >>> bool(abs(jnp.sqrt(q[:, 1:]).mean() / jnp.sqrt(3e-7) - 1) < 1e-2)  # unbiased
          True
        """
        steps, zero = _STEPS[signed], _ZERO[signed]
        flat = jnp.ravel(x).astype(_F32)
        if not signed:
            flat = jnp.sqrt(jnp.maximum(flat, 0.0))
        pad = (-flat.size) % block_size
        blocks = jnp.pad(flat, (0, pad)).reshape(-1, block_size)
        mag = jnp.abs(blocks)
        scales = jnp.max(mag, axis=1)
        r = mag / jnp.where(scales > 0, scales, 1.0)[:, None]  # in [0, 1]
        # The two codes around r: lo (the larger value) and lo + 1 (the smaller, or zero).
        exact = -steps * jnp.log2(jnp.maximum(r, 1e-38))
        lo = jnp.clip(jnp.floor(exact), 0, zero - 1)
        high = jnp.exp2(-lo / steps)
        low = jnp.where(lo + 1 >= zero, 0.0, high * np.float32(2.0 ** (-1 / steps)))
        up = jnp.clip((r - low) / (high - low), 0.0, 1.0)  # P(high): E[stored] = r
        u = jax.random.uniform(key, r.shape, _F32)
        code = jnp.where(u < up, lo, lo + 1).astype(jnp.uint8)
        if signed:
            code = code | jnp.where(blocks < 0, jnp.uint8(128), jnp.uint8(0))
        return cls(code, scales, np.shape(x), x.dtype, signed)

    def dequantize(self) -> jax.Array:
        """The moment, as its dtype and shape (see :meth:`quantize`).

        Example:
          >>> import jax, jax.numpy as jnp, mpjax
          >>> v = jnp.array([4.0, 1.0, 0.0, 0.25])
          >>> q = mpjax.QuantizedMoment.quantize(v, signed=False, block_size=4,
          ...                                    key=jax.random.key(0))
          >>> q.dequantize().tolist()   # powers of two of the largest are exact
          [4.0, 1.0, 0.0, 0.25]
        """
        steps, zero = _STEPS[self.signed], _ZERO[self.signed]
        code = self.codes & jnp.uint8(127) if self.signed else self.codes
        c = code.astype(_F32)
        mag = jnp.where(c >= zero, 0.0, jnp.exp2(-c / steps)) * self.scales[:, None]
        if self.signed:
            mag = jnp.where(self.codes >= 128, -mag, mag)
        else:
            mag = mag * mag
        size = int(np.prod(self.shape))
        return mag.reshape(-1)[:size].reshape(self.shape).astype(self.dtype)


jax.tree_util.register_pytree_node(
    QuantizedMoment,
    lambda q: ((q.codes, q.scales), (q.shape, q.dtype, q.signed)),
    lambda aux, children: QuantizedMoment(*children, *aux),
)


class QuantizedMomentsState(NamedTuple):
    """The state of :func:`quantize_moments`.

    Attributes:
      inner_state: the wrapped optimizer's state, each of its moment arrays a
        :class:`QuantizedMoment`.
      key: the PRNG key data the next rounding draws from.

    Example:
      >>> import jax.numpy as jnp, optax, mpjax
      >>> tx = mpjax.quantize_moments(optax.adam(1e-3), min_size=8)
      >>> state = tx.init({"w": jnp.zeros(16)})
      >>> [type(s).__name__ for s in (state.inner_state[0].mu["w"], state.inner_state[0].nu["w"])]
      ['QuantizedMoment', 'QuantizedMoment']
    """

    inner_state: Any
    key: jax.Array


def _is_q(x: Any) -> bool:
    return isinstance(x, QuantizedMoment)


def _field(path: tuple[Any, ...]) -> str | None:
    """The optax state field a leaf belongs to, if it is a known moment."""
    for k in reversed(path):
        name = getattr(k, "name", None)
        if name in FIRST or name in SECOND:
            return name
    return None


def quantize_moments(
    inner: optax.GradientTransformation,
    *,
    block_size: int = 256,
    min_size: int = 4096,
    key: jax.Array | int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Keeps `inner`'s moments in 8 bits: 1 byte per element and a float32 scale per block.

    The moment arrays of `inner`'s state (Adam's and Lion's ``mu``, Adam's ``nu``, SGD
    momentum's ``trace``, Adafactor's ``v``/``v_row``/``v_col``) with at least `min_size`
    elements are stored as :class:`QuantizedMoment`: blocks of `block_size` values, each with
    its largest magnitude as scale, and 8-bit logarithmic codes (2**(1/4) apart with a sign
    bit for first moments, 2**(1/8) apart for second moments, which are stored as their
    square roots), so that a block spans 2**-31 of its largest value (2**-63 for a second
    moment). Each update dequantizes them to float32, runs `inner`, and quantizes the new
    moments with unbiased stochastic rounding: small changes survive in expectation, as
    with :func:`mpjax.half_updates`'s stochastic mode. Other state (counts, small leaves)
    stays as `inner` keeps it.

    With bfloat16 params and :func:`mpjax.half_updates`, Adam costs about 4 bytes per
    parameter between steps (2 + 1 + 1 + 8 / `block_size`), against 12 with float32 masters:
    ``mpjax.loss_scale(mpjax.half_updates(mpjax.quantize_moments(optax.adam(1e-3))))``. A
    step that :func:`mpjax.loss_scale` skips leaves every byte of this state as it was. A
    leaf's last block is padded, so any block size fits any shape.

    Args:
      inner: an optax transformation that keeps moments (adam, adamw, lion, sgd with
        momentum, adafactor, ...).
      block_size: values per block (a positive int; 256 by default, as torchao's 8-bit Adam).
      min_size: moments with fewer elements stay as they are (biases, norms' scales).
      key: PRNG key or int seed of the stochastic rounding.

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a
      :class:`QuantizedMomentsState`.

    Raises:
      TypeError: if `inner` is not a GradientTransformation.
      ValueError: if `block_size` or `min_size` is not a positive int, or `inner`'s state has
        no moment of at least `min_size` elements (an optimizer without moments, such as
        plain SGD, has nothing to quantize).

    Example:
      >>> import jax, jax.numpy as jnp, optax, mpjax
      >>> params = {"w": jnp.ones((64, 64))}
      >>> tx = mpjax.quantize_moments(optax.adam(1e-2))
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.full((64, 64), 0.5)}
      >>> updates, state = tx.update(grads, state, params)
      >>> round(float(updates["w"][0, 0]), 4)     # Adam's first step: -lr * sign(g)
      -0.01
      >>> state.inner_state[0].mu["w"].codes.nbytes, state.inner_state[0].nu["w"].codes.nbytes
      (4096, 4096)
    """
    inner_tx = _check_inner(inner, "quantize_moments")
    for name, value in (("block_size", block_size), ("min_size", min_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"quantize_moments: {name} must be a positive int, got {value!r}.")
    key_data, impl = _key_and_impl(key)

    def moment(path: tuple[Any, ...], leaf: Any) -> str | None:
        field = _field(path)
        return field if _is_float(leaf) and np.prod(np.shape(leaf)) >= min_size else None

    def quantize(tree: Any, key: jax.Array) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        out = []
        for i, (path, leaf) in enumerate(leaves):
            field = moment(path, leaf)
            if field is None:
                out.append(leaf)
                continue
            k = jax.random.fold_in(key, i)
            out.append(QuantizedMoment.quantize(leaf, signed=field in FIRST,
                                                block_size=block_size, key=k))  # fmt: skip
        return jax.tree_util.tree_unflatten(treedef, out)

    def dequantize(tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: x.dequantize() if _is_q(x) else x, tree,
                                      is_leaf=_is_q)  # fmt: skip

    def init(params: optax.Params) -> QuantizedMomentsState:
        key = jax.random.wrap_key_data(jnp.asarray(key_data), impl=impl)
        init_key, next_key = jax.random.split(key)
        state = quantize(inner_tx.init(params), init_key)
        if not any(_is_q(x) for x in jax.tree_util.tree_leaves(state, is_leaf=_is_q)):
            raise ValueError(
                "quantize_moments: the optimizer's state has no moment array of at least "
                f"min_size={min_size} elements to keep in 8 bits (it quantizes Adam's mu and "
                "nu, Lion's mu, SGD momentum's trace, Adafactor's v). An optimizer without "
                "moments, such as optax.sgd(lr), needs no wrapping; for small models pass a "
                "smaller min_size."
            )
        return QuantizedMomentsState(state, jax.random.key_data(next_key))

    def update(
        updates: optax.Updates,
        state: QuantizedMomentsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, QuantizedMomentsState]:
        if not isinstance(state, QuantizedMomentsState):
            raise TypeError(
                f"quantize_moments().update got a state of type {type(state).__name__}; pass "
                "the state that this transformation's init returned."
            )
        key, round_key = jax.random.split(jax.random.wrap_key_data(state.key, impl=impl))
        inner_updates, inner_state = inner_tx.update(
            updates, dequantize(state.inner_state), params, **extra_args
        )
        new_state = QuantizedMomentsState(
            quantize(inner_state, round_key), jax.random.key_data(key)
        )
        return inner_updates, new_state

    return optax.GradientTransformationExtraArgs(init, update)
