"""Optimizer moments in 8 bits: blockwise-scaled 8-bit floats, rounded without bias."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpjax._src.dtypes import is_float
from mpjax._src.optim.half_params import (
    arrays_of,
    check_inner,
    key_and_impl,
    random_bits,
    u32,
    up_to,
    wrapped_like,
)

_F32 = jnp.dtype(jnp.float32)
# The optax state fields that hold moments: signed (momentum-like) and non-negative
# (second-moment-like). Adam, AdamW, Lion, SGD with momentum (trace), Adafactor (v, v_row,
# v_col), Adagrad/RMSProp (sum_of_squares, nu).
FIRST = frozenset({"mu", "trace", "momentum", "ema"})
SECOND = frozenset({"nu", "v", "v_row", "v_col", "sum_of_squares"})


class _Format(NamedTuple):
    """An 8-bit float relative to a block's largest magnitude: exponent and mantissa bits,
    a sign bit (signed moments) or the square root stored (non-negative ones)."""

    exponent: int
    mantissa: int
    signed: bool

    @property
    def bias(self) -> int:
        # float32's exponent field minus the code's: the block's largest (1.0, field 127)
        # takes the top exponent code.
        return 128 - 2**self.exponent

    @property
    def sub_step(self) -> np.float32:
        """The step of the linear grid below the smallest normal code (IEEE's subnormals)."""
        return np.float32(2.0 ** (self.bias - 126 - self.mantissa))

    @property
    def octaves(self) -> int:
        """How many powers of two below the block's largest the normal codes reach."""
        return 2**self.exponent - 2


# First moments: e4m3 (the default, as MS-AMP's and COAT's: 14 octaves, 8 codes per octave) or
# e5m2 (30 octaves, 4 per octave). Second moments as square roots, so the
# moment's own span is twice the code's: sqrt_e5m3 (60 octaves of the moment) or sqrt_e4m4 (28).
FORMATS = {
    "e5m2": _Format(5, 2, True),
    "e4m3": _Format(4, 3, True),
    "sqrt_e5m3": _Format(5, 3, False),
    "sqrt_e4m4": _Format(4, 4, False),
}
_FLOAT8 = {"float8_e5m2": "e5m2", "float8_e4m3fn": "e4m3", "float8_e4m3": "e4m3"}


def _quantize_unit(r: jax.Array, bits: jax.Array, f: _Format) -> jax.Array:
    """Codes for `r` in [0, 1], rounded up with probability equal to the fraction of the step
    (`bits`: 32 random bits per element). Normal codes round as float32 does to a float with
    `f.mantissa` mantissa bits: add random bits below them and truncate (unbiased, and exact
    across an octave's edge); below the smallest normal value the grid is linear."""
    shift = 23 - f.mantissa
    rb = jax.lax.bitcast_convert_type(r, jnp.uint32)
    normal = ((rb + (bits >> (32 - shift))) >> shift) - u32(f.bias << f.mantissa)
    q = r / f.sub_step
    floor = jnp.floor(q)
    u = (bits >> 8).astype(_F32) * np.float32(2.0**-24)
    sub = (floor + (u < q - floor)).astype(jnp.uint32)
    return jnp.where(rb >= u32((f.bias + 1) << 23), normal, sub)


def _dequantize_unit(code: jax.Array, f: _Format) -> jax.Array:
    """The value in [0, 1] a code stands for (see `_quantize_unit`)."""
    c = code.astype(jnp.uint32)
    e = c >> f.mantissa
    normal = jax.lax.bitcast_convert_type(
        (c + u32(f.bias << f.mantissa)) << (23 - f.mantissa), jnp.float32
    )
    sub = c.astype(_F32) * f.sub_step
    return jnp.where(e > 0, normal, sub)


def _rows(shape: tuple[int, ...], block_size: int, first: int = 0) -> tuple[int, int]:
    """The 2-D view ``[rows, cols]`` blocks run along: `cols` is the product of the fewest
    trailing axes that reach `block_size` (all of them from axis `first` for a small
    array)."""
    cols = 1
    for k in range(len(shape) - 1, first - 1, -1):
        cols *= shape[k]
        if cols >= block_size:
            break
    size = int(np.prod(shape, dtype=np.int64))
    return (size // cols if cols else 0), cols


def _sharded_axes(x: Any) -> tuple[int, ...]:
    """The axes of `x` sharded over explicit mesh axes (its type's sharding; none under
    Auto axes, where the sharding is not part of the type)."""
    try:
        spec = jax.typeof(x).sharding.spec
    except Exception:  # noqa: BLE001 - a value without a sharding in its type
        return ()
    return tuple(i for i, s in enumerate(spec) if s is not None)


def _view(x: Any, block_size: int) -> tuple[int, int] | None:
    """`x`'s ``[rows, cols]`` view, or None where no local view exists: under explicit axes
    blocks run along the axes after the last sharded one (merging a sharded axis into the
    blocks would move data between devices), and the rows may hold one sharded axis, the
    first."""
    sharded = _sharded_axes(x)
    if not sharded:
        return _rows(np.shape(x), block_size)
    if sharded != (0,):
        return None
    return _rows(np.shape(x), block_size, first=1)


def _magnitudes(x: jax.Array, f: _Format, block_size: int) -> jax.Array:
    """`x` as float32 (its square root for a non-negative format) in its ``[rows, cols]``
    view."""
    view = _view(x, block_size)
    assert view is not None  # quantize_moments keeps such leaves as they are
    v = jnp.asarray(x).astype(_F32).reshape(view)
    return v if f.signed else jnp.sqrt(jnp.maximum(v, 0.0))


def _blocks(v: jax.Array, block_size: int) -> jax.Array:
    """``|v|`` in blocks, ``[rows, ceil(cols / block_size), block_size]`` (a short last block
    padded with zeros)."""
    rows, cols = v.shape
    blocks = -(-cols // block_size)
    padded = jnp.pad(jnp.abs(v), ((0, 0), (0, blocks * block_size - cols)))
    return padded.reshape(rows, blocks, block_size)


def _block_max(v: jax.Array, block_size: int) -> jax.Array:
    """Each block's largest magnitude: ``[rows, ceil(cols / block_size)]``."""
    return jnp.max(_blocks(v, block_size), axis=-1)


def _block_maxima(vs: list[jax.Array], block_size: int) -> list[jax.Array]:
    """`_block_max` of each of `vs` (one shape), as one reduction: XLA then reads every
    moment's new values in one pass for all their scales, instead of one pass per moment."""
    if len(vs) == 1:
        return [_block_max(vs[0], block_size)]
    out = jax.lax.reduce(
        tuple(_blocks(v, block_size) for v in vs),
        tuple(np.float32(0) for _ in vs),
        lambda a, b: tuple(jnp.maximum(x, y) for x, y in zip(a, b, strict=True)),
        (2,),
    )
    return list(out)


# How many moments of one shape share a block-maxima reduction (see _block_maxima). One
# reduction for all 64 moments of a GPT's attention kernels made XLA keep some of them in
# float32 between the passes, in its H100 program.
_GROUP = 8


def _spread(scales: jax.Array, cols: int, block_size: int) -> jax.Array:
    """Block values ``[rows, blocks]`` repeated over their elements: ``[rows, cols]``."""
    rows, blocks = scales.shape
    wide = jnp.broadcast_to(jnp.expand_dims(scales, 2), (rows, blocks, block_size))
    # a slice, not indexing (a gather, which JAX 0.6 refuses under explicit mesh axes)
    return jax.lax.slice_in_dim(wide.reshape(rows, blocks * block_size), 0, cols, axis=1)


class QuantizedMoment:
    """One moment array stored in 8 bits: a uint8 code per element, a float32 scale per block.

    Each code is an 8-bit float relative to its block's largest magnitude (the scale): for a
    signed (first) moment a sign bit and e5m2 or e4m3, for a non-negative (second) moment the
    square root, unsigned, in e5m3 or e4m4, so the moment itself spans twice the octaves.
    Below a format's smallest normal value the codes are a linear grid down to zero, as IEEE
    subnormals are. Blocks run along the trailing axes (the fewest whose product reaches the
    block size), so the codes keep the moment's shape (and shard as it does); a row's last
    block may be short.

    Attributes:
      codes: uint8, the moment's shape.
      scales: float32 ``[rows, blocks per row]``: each block's largest magnitude.
      shape: the moment's shape.
      dtype: the moment's dtype when dequantized.
      fmt: the code format: ``"e5m2"``, ``"e4m3"``, ``"sqrt_e5m3"`` or ``"sqrt_e4m4"``.
      block_size: values per block.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> m = jnp.array([0.5, -0.25, 0.0, 1e-3])
      >>> q = mpjax.QuantizedMoment.quantize(m, "e5m2", block_size=4, key=jax.random.key(0))
      >>> q.codes.dtype, q.scales.tolist(), q.dequantize().tolist()[:3]
      (dtype('uint8'), [[0.5]], [0.5, -0.25, 0.0])
    """

    def __init__(
        self, codes: Any, scales: Any, shape: tuple[int, ...], dtype: Any, fmt: str,
        block_size: int,
    ):  # fmt: skip
        self.codes, self.scales = codes, scales
        self.shape, self.dtype, self.fmt = tuple(shape), np.dtype(dtype), str(fmt)
        self.block_size = int(block_size)

    @property
    def signed(self) -> bool:
        """Whether the moment can be negative (a first moment's format).

        Example:
          >>> import jax, jax.numpy as jnp, mpjax
          >>> q = mpjax.QuantizedMoment.quantize(jnp.ones(4), "sqrt_e5m3", block_size=4,
          ...                                    key=jax.random.key(0))
          >>> q.signed
          False
        """
        return FORMATS[self.fmt].signed

    def __repr__(self) -> str:
        return (
            f"QuantizedMoment({self.fmt}, shape={self.shape}, "
            f"scales={np.shape(self.scales)}, block_size={self.block_size})"
        )

    @classmethod
    def quantize(
        cls,
        x: jax.Array,
        fmt: str,
        *,
        block_size: int,
        key: jax.Array,
        scales: jax.Array | None = None,
    ) -> QuantizedMoment:
        """Quantizes `x` blockwise, rounding each value to one of its two neighbouring codes
        with the probabilities that make the stored value's expectation exact (the square
        root's, for a non-negative moment). `scales`, if given, are the block maxima (of the
        square roots, for a non-negative format) computed elsewhere.

        Example:
          >>> import jax, jax.numpy as jnp, mpjax
          >>> v = jnp.full(256, 3e-7)
          >>> keys = jax.random.split(jax.random.key(0), 2000)
          >>> q = jax.vmap(lambda k: mpjax.QuantizedMoment.quantize(
          ...     v.at[0].set(1.0), "sqrt_e5m3", block_size=256, key=k).dequantize())(keys)
          >>> bool(abs(jnp.sqrt(q[:, 1:]).mean() / jnp.sqrt(3e-7) - 1) < 1e-2)  # unbiased
          True
        """
        f = FORMATS[fmt]
        v = _magnitudes(x, f, block_size)
        if scales is None:
            scales = _block_max(v, block_size)
        inv = jnp.where(scales > 0, 1.0 / scales, 0.0)
        r = jnp.minimum(jnp.abs(v) * _spread(inv, v.shape[1], block_size), 1.0)
        code = _quantize_unit(r, random_bits(key, r.shape), f)
        if f.signed:
            code = code | jnp.where(v < 0, u32(128), u32(0))
        codes = code.astype(jnp.uint8).reshape(np.shape(x))
        return cls(codes, scales, np.shape(x), x.dtype, fmt, block_size)

    def dequantize(self) -> jax.Array:
        """The moment, as its dtype and shape (see :meth:`quantize`).

        Example:
          >>> import jax, jax.numpy as jnp, mpjax
          >>> v = jnp.array([4.0, 1.0, 0.0, 0.25])
          >>> q = mpjax.QuantizedMoment.quantize(v, "sqrt_e5m3", block_size=4,
          ...                                    key=jax.random.key(0))
          >>> q.dequantize().tolist()   # powers of two of the largest are exact
          [4.0, 1.0, 0.0, 0.25]
        """
        f = FORMATS[self.fmt]
        codes = self.codes.reshape(self.scales.shape[0], -1)  # the [rows, cols] view
        code = codes & jnp.uint8(127) if f.signed else codes
        scale = _spread(self.scales, codes.shape[1], self.block_size)
        mag = _dequantize_unit(code, f) * scale
        if f.signed:
            mag = jnp.where(codes >= 128, -mag, mag)
        else:
            mag = mag * mag
        return mag.reshape(self.shape).astype(self.dtype)


jax.tree_util.register_pytree_node(
    QuantizedMoment,
    lambda q: ((q.codes, q.scales), (q.shape, q.dtype, q.fmt, q.block_size)),
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


def _group_scales(
    groups: dict[Any, list[int]], mags: dict[int, jax.Array], block_size: int
) -> dict[int, jax.Array]:
    """Each moment's block maxima, read in one pass for up to _GROUP moments of one shape."""
    scales: dict[int, jax.Array] = {}
    for same in groups.values():
        for start in range(0, len(same), _GROUP):
            members = same[start : start + _GROUP]
            found = _block_maxima([mags[i] for i in members], block_size)
            scales.update(zip(members, found, strict=True))
    return scales


def _is_q(x: Any) -> bool:
    return isinstance(x, QuantizedMoment)


def _field(path: tuple[Any, ...]) -> str | None:
    """The optax state field a leaf belongs to, if it is a known moment."""
    for k in reversed(path):
        name = getattr(k, "name", None)
        if name in FIRST or name in SECOND:
            return name
    return None


def _format(value: Any, which: str) -> str:
    """The format name for `first=`/`second=`, or an error that names the choices."""
    name = value
    if not isinstance(value, str):
        try:
            name = np.dtype(value).name
        except TypeError:
            name = repr(value)
    name = _FLOAT8.get(name, name)
    signed = which == "first"
    choices = sorted(k for k, f in FORMATS.items() if f.signed == signed)
    if name in FORMATS and FORMATS[name].signed == signed:
        return name
    if not signed and name in FORMATS:
        f = FORMATS[name]
        raise ValueError(
            f"quantize_moments: second={value!r} cannot hold a second moment's range: {name} "
            f"codes reach 2**-{f.octaves} of a block's largest value, and a second moment is "
            "the square of the gradients, so a block whose gradients span "
            f"2**-{f.octaves // 2} already needs all of it (smaller values round to zero, "
            "and Adam divides by their square roots). Store the square root: "
            f"second='sqrt_e5m3' (the default, 2**-60 of the largest) or 'sqrt_e4m4'."
        )
    if signed and name in FORMATS:
        raise ValueError(
            f"quantize_moments: first={value!r} stores a square root, which holds only "
            "non-negative values, and a first moment changes sign; use first='e4m3' (the "
            "default) or 'e5m2'."
        )
    raise ValueError(
        f"quantize_moments: {which}={value!r} is not an 8-bit moment format; pass one of "
        f"{choices}" + (" (or jnp.float8_e5m2 / jnp.float8_e4m3fn)." if signed else ".")
    )


class _Codec(NamedTuple):
    """Which leaves of an optimizer's state quantize_moments keeps in 8 bits, and how."""

    block_size: int
    min_size: int
    first_fmt: str
    second_fmt: str

    def moment(self, path: tuple[Any, ...], leaf: Any) -> str | None:
        """The moment field `leaf` is (``mu``, ``nu``, ...), or None to keep it as it is."""
        field = _field(path)
        big = is_float(leaf) and np.prod(np.shape(leaf)) >= self.min_size
        # a leaf sharded over explicit axes other than its first has no local block view
        return field if big and _view(leaf, self.block_size) is not None else None

    def quantize(self, tree: Any, key: jax.Array, shadow: Any = None) -> Any:
        """`tree` with its moments quantized; their block scales from `shadow`'s twins of
        them where given (see quantize_moments' `recompute`)."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        twins = [None] * len(leaves) if shadow is None else up_to(treedef, shadow)
        fmts: dict[int, str] = {}
        groups: dict[Any, list[int]] = {}
        mags: dict[int, jax.Array] = {}
        for i, ((path, leaf), twin) in enumerate(zip(leaves, twins, strict=True)):
            field = self.moment(path, leaf)
            if field is None:
                continue
            fmts[i] = self.first_fmt if field in FIRST else self.second_fmt
            source = leaf if twin is None else twin
            mags[i] = _magnitudes(source, FORMATS[fmts[i]], self.block_size)
            groups.setdefault((np.shape(leaf), mags[i].shape), []).append(i)
        scales = _group_scales(groups, mags, self.block_size)
        out = []
        for i, (_, leaf) in enumerate(leaves):
            if i not in fmts:
                out.append(leaf)
                continue
            k = jax.random.fold_in(key, i)
            out.append(QuantizedMoment.quantize(leaf, fmts[i], block_size=self.block_size, key=k,
                                                scales=scales[i]))  # fmt: skip
        return jax.tree_util.tree_unflatten(treedef, out)

    @staticmethod
    def dequantize(tree: Any) -> Any:
        """`tree` with its quantized moments in float32."""
        return jax.tree_util.tree_map(lambda x: x.dequantize() if _is_q(x) else x, tree,
                                      is_leaf=_is_q)  # fmt: skip


def _check_has_moments(state: Any, min_size: int) -> None:
    if not any(_is_q(x) for x in jax.tree_util.tree_leaves(state, is_leaf=_is_q)):
        raise ValueError(
            "quantize_moments: the optimizer's state has no moment array of at least "
            f"min_size={min_size} elements to keep in 8 bits (it quantizes Adam's mu and "
            "nu, Lion's mu, SGD momentum's trace, Adafactor's v). An optimizer without "
            "moments, such as optax.sgd(lr), needs no wrapping; for small models pass a "
            "smaller min_size."
        )


def _check_state(state: Any) -> None:
    if not isinstance(state, QuantizedMomentsState):
        raise TypeError(
            f"quantize_moments().update got a state of type {type(state).__name__}; pass "
            "the state that this transformation's init returned."
        )


def quantize_moments(
    inner: optax.GradientTransformation,
    *,
    block_size: int = 256,
    min_size: int = 4096,
    first: Any = "e4m3",
    second: Any = "sqrt_e5m3",
    key: jax.Array | int = 0,
    recompute: bool | None = True,
) -> optax.GradientTransformationExtraArgs:
    """Keeps `inner`'s moments in 8 bits: 1 byte per element and a float32 scale per block.

    The moment arrays of `inner`'s state (Adam's and Lion's ``mu``, Adam's ``nu``, SGD
    momentum's ``trace``, Adafactor's ``v``/``v_row``/``v_col``) with at least `min_size`
    elements are stored as :class:`QuantizedMoment`: blocks of `block_size` values, each with
    its largest magnitude as scale, and an 8-bit float per value relative to that scale. A
    first moment takes a sign bit and e4m3 (the default, the first-moment format of MS-AMP
    and COAT: 14 octaves below the block's largest, 8 codes per octave) or e5m2 (30 octaves,
    4 per octave); a second moment is stored as its square root in e5m3 (the default:
    60 octaves of the moment) or e4m4 (28), since it spans the square of the gradients'
    range. Each update dequantizes them to float32, runs `inner`, and quantizes the new
    moments with unbiased stochastic rounding: small changes survive in expectation, as
    with :func:`mpjax.half_updates`'s stochastic mode. Other state (counts, small leaves)
    stays as `inner` keeps it. Quantizing and dequantizing are integer and bit operations
    (no logarithm), fused by XLA into the update's loops.

    With bfloat16 params and :func:`mpjax.half_updates`, Adam costs about 4 bytes per
    parameter between steps (2 + 1 + 1 + 8 / `block_size`), against 12 with float32 masters:
    ``mpjax.loss_scale(mpjax.half_updates(mpjax.quantize_moments(optax.adam(1e-3))))``. A
    step that :func:`mpjax.loss_scale` skips leaves every byte of this state as it was.
    Blocks run along each moment's trailing axes and a row's last block may be short, so any
    block size fits any shape and the codes keep the moment's shape.

    Args:
      inner: an optax transformation that keeps moments (adam, adamw, lion, sgd with
        momentum, adafactor, ...).
      block_size: values per block (a positive int; 256 by default, as torchao's 8-bit Adam).
      min_size: moments with fewer elements stay as they are (biases, norms' scales).
      first: the first moments' format: ``"e4m3"`` (default) or ``"e5m2"``; the dtypes
        ``jnp.float8_e4m3fn`` and ``jnp.float8_e5m2`` name them too. e4m3's extra mantissa
        bit is what Lion needs (its step is the sign of the first moment; the half-params
        guide has the measurement).
      second: the second moments' format: ``"sqrt_e5m3"`` (default) or ``"sqrt_e4m4"``.
      key: PRNG key or int seed of the stochastic rounding.
      recompute: where the block scales come from. A block's scale is its largest new
        value, needed before any of its codes; the maxima of up to 8 moments of one shape are
        one reduction, which reads their gradients and codes once. With ``True`` (the
        default; ``None`` means it too) a second evaluation of `inner` feeds only the
        maxima, so the new float32 moments are computed again in the pass that writes the
        codes and never go to memory. With ``False`` `inner` is evaluated once and XLA
        decides, per moment, whether to keep the new moments in float32 between the two
        passes. ``benchmarks/RESULTS.md`` has both on a CPU and in the H100 program.

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a
      :class:`QuantizedMomentsState`.

    Raises:
      TypeError: if `inner` is not a GradientTransformation.
      ValueError: if `block_size` or `min_size` is not a positive int; if a format is
        unknown, or cannot hold its moment (a square root for a first moment, which changes
        sign; e4m3 or e5m2 for a second moment, whose range they cannot hold); or if
        `inner`'s state has no moment of at least `min_size` elements (an optimizer without
        moments, such as plain SGD, has nothing to quantize).

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
    inner_tx = check_inner(inner, "quantize_moments")
    for name, value in (("block_size", block_size), ("min_size", min_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"quantize_moments: {name} must be a positive int, got {value!r}.")
    codec = _Codec(block_size, min_size, _format(first, "first"), _format(second, "second"))
    key_data, impl = key_and_impl(key)
    quantize, dequantize = codec.quantize, codec.dequantize

    def init(params: optax.Params) -> QuantizedMomentsState:
        key = jax.random.wrap_key_data(jnp.asarray(key_data), impl=impl)
        init_key, next_key = jax.random.split(key)
        # nnx.Optimizer passes its params as Variables and wraps each array of the state in
        # one: a moment built inside a Param would be wrapped whole, and Flax would then
        # store it back as its parts. From the arrays, each part is wrapped on its own.
        state = quantize(inner_tx.init(arrays_of(params)), init_key)
        _check_has_moments(state, min_size)
        return QuantizedMomentsState(state, jax.random.key_data(next_key))

    def update(
        updates: optax.Updates,
        state: QuantizedMomentsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, QuantizedMomentsState]:
        _check_state(state)
        key, round_key = jax.random.split(jax.random.wrap_key_data(state.key, impl=impl))
        given = updates  # the state holds arrays, not NNX Variables (see init)
        updates, params = arrays_of(updates), arrays_of(params)
        inner_updates, inner_state = inner_tx.update(
            updates, dequantize(state.inner_state), params, **extra_args
        )
        shadow = None
        if recompute is None or recompute:
            # The block scales from a second evaluation of `inner` that XLA cannot merge with
            # the first: its moments feed only the block maxima. The barrier is on the stored
            # codes alone, so it makes XLA write nothing (a barrier on the gradients made it
            # write them in float32).
            q = jax.lax.optimization_barrier(state.inner_state)
            _, shadow = inner_tx.update(updates, dequantize(q), params, **extra_args)
        new_state = QuantizedMomentsState(
            quantize(inner_state, round_key, shadow), jax.random.key_data(key)
        )
        return wrapped_like(given, inner_updates), new_state

    return optax.GradientTransformationExtraArgs(init, update)
