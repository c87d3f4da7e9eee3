"""Training with half-precision params and no float32 master copy: `stochastic_round` and the
`half_updates` optax wrapper (stochastic rounding or Kahan-compensated updates)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike, DTypeLike

from mpjax._src import policy as policy_lib
from mpjax._src.dtypes import is_float, is_half

_F32 = np.dtype(np.float32)
_BF16 = np.dtype(jnp.bfloat16)
_F16 = np.dtype(jnp.float16)
_HALF = (_F16, _BF16)
MODES = ("stochastic", "kahan", "nearest")


def u32(value: int) -> jax.Array:
    return jnp.asarray(np.uint32(value))


def _round_target(dtype: Any, arg: str = "dtype") -> np.dtype:
    dtype = policy_lib.canonical_float_dtype(dtype, arg)
    if dtype not in (*_HALF, _F32):
        raise ValueError(
            f"{arg} must be bfloat16 or float16 (or float32, where nothing is rounded), got "
            f"{dtype}."
        )
    return dtype


def stochastic_round(key: jax.Array, x: ArrayLike, dtype: DTypeLike) -> jax.Array:
    """Rounds `x` to `dtype` stochastically: up or down with odds that make it unbiased.

    Each element goes to one of the two `dtype` values around it, the upper one with
    probability equal to its distance from the lower one in units of their gap, so the
    expected result is `x` itself (Zamirai et al., 2020; Gopher, Rae et al., 2021, appendix
    C). Values `dtype` holds exactly come back unchanged; 0 keeps its sign; ``inf``, ``nan``
    and values beyond ``±finfo(dtype).max`` come back as a plain ``astype`` gives them, since
    there is no larger finite neighbour to round to. Half inputs are widened to float32
    first (exactly); float64 inputs are rounded to float32 to nearest first.

    It is exact (every probability a multiple of 2**-16 or 2**-13, drawn from as many random
    bits) for bfloat16 and for float16's normal range; in float16's subnormal range (below
    2**-14) the odds are drawn to 2**-32.

    Args:
      key: a JAX PRNG key (typed or raw). The same key and input give the same result, under
        ``jax.jit`` or not.
      x: a floating-point array.
      dtype: ``"bfloat16"``, ``"float16"`` (or a dtype; jmp's short names work). float32
        returns ``x`` cast to float32, nothing to round.

    Returns:
      An array of `dtype` with the shape of `x`.

    Raises:
      TypeError: if `x` is not a floating-point array.
      ValueError: for a `dtype` that is not float16, bfloat16 or float32.

    References:
      Zamirai et al., 2020, "Revisiting BFloat16 Training", https://arxiv.org/abs/2010.06192

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> x = jnp.full(10_000, 1.0 + 2.0**-10)   # 1/8 of the way from 1 to bfloat16's next value
      >>> jnp.mean(x.astype(jnp.bfloat16) == 1.0)  # to nearest: always 1.0
      Array(1., dtype=float32)
      >>> y = mpjax.stochastic_round(jax.random.key(0), x, "bfloat16")
      >>> sorted(set(y.tolist())), round(float(jnp.mean(y.astype(jnp.float32))), 4)
      ([1.0, 1.0078125], 1.001)
    """
    if not is_float(x):
        raise TypeError(
            f"stochastic_round rounds floating-point arrays, got "
            f"{getattr(x, 'dtype', type(x).__name__)}; pass x as a float array "
            "(e.g. jnp.asarray(x, jnp.float32))."
        )
    x = jnp.asarray(x)
    target = _round_target(dtype)
    if target == _F32 or np.dtype(x.dtype) == target:
        return x.astype(target)
    key = _typed_key(key)
    x32 = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x32, jnp.uint32)
    r = random_bits(key, x32.shape)
    if target == _BF16:
        # bfloat16 is float32 with the low 16 bits dropped: add 16 random bits, truncate
        # (torchao's bf16 stochastic rounding does the same).
        up = (bits + (r >> 16)) & u32(0xFFFF0000)
        rounded = jax.lax.bitcast_convert_type(up, jnp.float32)
    else:
        # float16's normal range: 10 of float32's 23 mantissa bits, so add 13 random bits.
        normal = jax.lax.bitcast_convert_type((bits + (r >> 19)) & u32(0xFFFFE000), jnp.float32)
        # Its subnormal range is a fixed grid of 2**-24: round the multiple of it.
        scaled = jnp.abs(x32) * np.float32(2.0**24)  # exact: a power-of-two scaling
        floor = jnp.floor(scaled)
        odds = ((scaled - floor) * np.float32(2.0**32)).astype(jnp.uint32)
        sub = jnp.copysign((floor + (r < odds)) * np.float32(2.0**-24), x32)
        rounded = jnp.where(jnp.abs(x32) < np.float32(2.0**-14), sub, normal)
    # Finite values up to the largest finite one; the rest (inf, nan, beyond max) as a cast.
    inside = jnp.abs(x32) <= np.float32(jnp.finfo(target).max)
    return jnp.where(inside, rounded.astype(target), x32.astype(target))


def _mix(x: jax.Array) -> jax.Array:
    """A bijective 32-bit integer hash (Wellons' lowbias32: two xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = x * u32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * u32(0x846CA68B)
    return x ^ (x >> 16)


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """32 random bits per element for rounding: a counter hash seeded by two draws from `key`.

    ``jax.random.bits`` runs threefry per element, several times the cost of the update it
    rounds. Here the key gives two 32-bit seeds and each
    element hashes its index with them: for a fresh key every element's bits are exactly
    uniform (the hash is a bijection of the seed), and neighbours are decorrelated by the
    hash. Elementwise integer work that XLA fuses into the rounding's loop.
    """
    seed = jax.random.bits(_typed_key(key), (2,), jnp.uint32)
    size = int(np.prod(shape, dtype=np.int64))
    index = jax.lax.iota(jnp.uint32, size).reshape(shape) if size else jnp.zeros(shape, jnp.uint32)
    return _mix(_mix(index + seed[0]) ^ seed[1])


def is_variable(x: Any) -> bool:
    """Whether `x` is an NNX Variable (nnx.Param, nnx.OptArray, ...)."""
    return hasattr(x, "get_metadata") and hasattr(x, "replace")


def variable_value(variable: Any) -> Any:
    """The array an NNX Variable holds."""
    get = getattr(variable, "get_value", None)  # Flax >= 0.12; .value before (deprecated now)
    return get() if callable(get) else variable.value


def arrays_of(tree: Any) -> Any:
    """`tree` with each NNX Variable replaced by the array it holds (other trees as they
    are)."""
    if tree is None or not any(
        is_variable(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_variable)
    ):
        return tree
    return jax.tree_util.tree_map(
        lambda x: variable_value(x) if is_variable(x) else x, tree, is_leaf=is_variable
    )


def wrapped_like(like: Any, tree: Any) -> Any:
    """`tree` (arrays) wrapped in the Variables `like` has where it has them."""
    if tree is like or not any(
        is_variable(x) for x in jax.tree_util.tree_leaves(like, is_leaf=is_variable)
    ):
        return tree
    return jax.tree_util.tree_map(
        lambda w, x: w.replace(x) if is_variable(w) else x, like, tree, is_leaf=is_variable
    )


def up_to(treedef: Any, tree: Any) -> list[Any]:
    """The leaves of `tree` down to the leaves of `treedef` (its subtrees stay whole)."""
    return treedef.flatten_up_to(tree)


def _typed_key(key: Any) -> jax.Array:
    if hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if hasattr(key, "dtype") and np.dtype(key.dtype) == np.uint32:
        return jax.random.wrap_key_data(key)
    raise TypeError(
        f"Expected a PRNG key (jax.random.key(seed)), got {getattr(key, 'dtype', type(key))}."
    )


def key_and_impl(key: Any) -> tuple[jax.Array, Any]:
    if isinstance(key, bool) or not isinstance(key, (int, np.integer, jax.Array, np.ndarray)):
        raise TypeError(f"key must be an int seed or a PRNG key (jax.random.key(0)), got {key!r}.")
    seed = np.ndim(key) == 0 and jnp.issubdtype(np.result_type(key), jnp.integer)
    # An integer scalar is a seed (traced ones too: vmap over seeds); else a key.
    typed = jax.random.key(key) if seed else _typed_key(key)
    if typed.shape != ():
        raise ValueError(
            f"key must be a single PRNG key, got an array of {typed.shape} keys; pass one "
            "(e.g. jax.random.key(0)): each step splits it."
        )
    # Stored as raw key data (uint32): orbax, jnp.where (MultiSteps, loss_scale's skip) and
    # nnx's state all handle it as any other array.
    return jax.random.key_data(typed), jax.random.key_impl(typed)


def _split(m: jax.Array, dtype: np.dtype) -> tuple[jax.Array, jax.Array]:
    """A float32 value as (its half value, the rest in int16): `_join` gives it back exactly
    (float16: in its normal range; below it, to 2**-39)."""
    if dtype == _BF16:
        # bfloat16 is float32's high 16 bits: round them (ties away from zero, so that the
        # rest fits int16: -0x8000..0x7FFF) and keep the low 16 bits' difference.
        mb = jax.lax.bitcast_convert_type(m, jnp.uint32)
        hb = (mb + u32(0x8000)) >> 16
        half = jax.lax.bitcast_convert_type(hb.astype(jnp.uint16), jnp.bfloat16)
        rest = jax.lax.bitcast_convert_type(mb - (hb << 16), jnp.int32).astype(jnp.int16)
    else:
        half = m.astype(dtype)
        rest = jnp.round((m - half.astype(_F32)) / _unit(half)).astype(jnp.int16)
    finite = jnp.isfinite(m)
    return jnp.where(finite, half, m.astype(dtype)), jnp.where(finite, rest, jnp.int16(0))


def _join(half: jax.Array, rest: jax.Array) -> jax.Array:
    """The float32 value that `_split` made into (half, rest)."""
    if np.dtype(half.dtype) == _BF16:
        hb = jax.lax.bitcast_convert_type(half, jnp.uint16).astype(jnp.uint32) << 16
        low = jax.lax.bitcast_convert_type(rest.astype(jnp.int32), jnp.uint32)
        m = jax.lax.bitcast_convert_type(hb + low, jnp.float32)
    else:
        m = half.astype(_F32) + rest.astype(_F32) * _unit(half)
    return jnp.where(jnp.isfinite(half), m, half.astype(_F32))


def _unit(half: jax.Array) -> jax.Array:
    """2**-15 of float16's gap at `half`: the rest's unit (|rest| <= 2**14, an integer)."""
    exponent = (jax.lax.bitcast_convert_type(half, jnp.uint16) >> 10) & jnp.uint16(0x1F)
    return jnp.ldexp(np.float32(1.0), jnp.maximum(exponent.astype(jnp.int32), 1) - 40)


class HalfUpdatesState(NamedTuple):
    """State of :func:`half_updates`.

    Attributes:
      inner_state: the wrapped optimizer's state (its moment-like leaves in ``state_dtype``
        when one was asked for).
      key: the rounding key's raw data (uint32), split on every step; None when nothing is
        rounded stochastically (``"kahan"`` and ``"nearest"`` without ``state_dtype``).
      compensation: ``"kahan"`` only, else None: per half param, int16, the bits of its
        float32 value below the half one (an empty array for a float32 param).

    Example:
      >>> import jax.numpy as jnp, optax, mpjax
      >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> state = mpjax.half_updates(optax.adam(1e-3), "kahan").init(params)
      >>> state.key is None, state.compensation["w"].dtype
      (True, dtype('int16'))
    """

    inner_state: optax.OptState
    key: jax.Array | None
    compensation: optax.Updates | None


def check_inner(inner: Any, caller: str = "half_updates") -> optax.GradientTransformationExtraArgs:
    if isinstance(inner, optax.GradientTransformation):
        return optax.with_extra_args_support(inner)
    if isinstance(inner, optax.MultiSteps):
        return optax.with_extra_args_support(inner.gradient_transformation())
    if callable(inner):
        name = getattr(inner, "__name__", repr(inner))
        raise TypeError(
            f"{caller}(inner) takes an optax GradientTransformation, got the function "
            f"{name}; call it first, e.g. mpjax.{caller}(optax.{name}(1e-3))."
        )
    raise TypeError(
        f"{caller}(inner) takes an optax GradientTransformation (e.g. optax.adam(1e-3)), "
        f"got {type(inner).__name__}."
    )


def _check_mode(mode: Any) -> str:
    if mode not in MODES:
        hint = ""
        if isinstance(mode, str) and mode.lower() in ("sr", "stochastic_rounding", "random"):
            hint = " (stochastic rounding is mode='stochastic')"
        elif isinstance(mode, str) and mode.lower() in ("compensated", "kahan_sum", "kahan-sum"):
            hint = " (compensated summation is mode='kahan')"
        raise ValueError(
            f"Unknown mode {mode!r}: use 'stochastic' (unbiased stochastic rounding), 'kahan' "
            f"(a 16-bit compensation buffer per param, deterministic) or 'nearest' (plain "
            f"round-to-nearest, the baseline that loses small updates){hint}."
        )
    return mode


def _check_state_dtype(state_dtype: Any) -> np.dtype | None:
    if state_dtype is None:
        return None
    dtype = policy_lib.canonical_float_dtype(state_dtype, "state_dtype")
    if dtype == _F16:
        raise ValueError(
            "state_dtype='float16' cannot hold Adam's second moment: it stores squared "
            "gradients, and a gradient below 2**-12 squares to below float16's smallest "
            "subnormal (2**-24), so it becomes 0 and the step m / (sqrt(v) + eps) blows up. "
            "Use state_dtype='bfloat16' (float32's range), or keep the state in float32 "
            "(state_dtype=None) and put only the first moment in float16 with "
            "optax.adam(..., mu_dtype=jnp.float16)."
        )
    if dtype not in (_BF16, _F32):
        raise ValueError(f"state_dtype must be 'bfloat16' or None (float32), got {dtype}.")
    return None if dtype == _F32 else dtype


def _check_params(params: Any, caller: str) -> None:
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not is_float(p):
            raise ValueError(
                f"{caller}: param {jax.tree_util.keystr(path)} has dtype "
                f"{getattr(p, 'dtype', type(p).__name__)}; only floating-point params can be "
                "updated. Keep integer or key state out of the params (e.g. in a separate "
                "collection), or route it past the optimizer with optax.multi_transform."
            )


def _check_half_params(params: Any) -> None:
    """half_updates' checks of the params it is given; a warning where none is half."""
    _check_params(params, "half_updates")
    if not any(is_half(p) for p in jax.tree_util.tree_leaves(params)):
        warnings.warn(
            "half_updates: no param is float16 or bfloat16, so it changes nothing. Store "
            "the params in half, e.g. with mpjax.Policy.from_level('O2', "
            "master_weights=False).cast_to_param(params).",
            UserWarning,
            stacklevel=3,
        )


def _update_leaves(updates: Any, state: Any, params: Any) -> tuple[list[Any], Any, list[Any]]:
    """half_updates' update arguments checked: the param leaves, their treedef, and the
    gradient leaves in the params' structure."""
    if not isinstance(state, HalfUpdatesState):
        raise TypeError(
            f"half_updates().update got a state of type {type(state).__name__}; pass the "
            "state that this transformation's init returned."
        )
    if params is None:
        raise ValueError(
            "half_updates needs the current params to round the new ones: call "
            "tx.update(grads, opt_state, params)."
        )
    _check_params(params, "half_updates")
    p_leaves, treedef = jax.tree_util.tree_flatten(params)
    try:
        g_leaves = up_to(treedef, updates)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"half_updates: the gradients and params have different structures ({e}); pass "
            "jax.grad's output for these params."
        ) from None
    return p_leaves, treedef, g_leaves


def _rounded_updates(
    mode: str, p_leaves: list[Any], u_leaves: list[Any], c_leaves: list[Any] | None, key: Any
) -> tuple[list[Any], list[Any]]:
    """half_updates' updates, leaf by leaf, such that ``p + update`` is ``p + u`` rounded to
    the param's dtype in `mode`, and the new compensation buffers (``"kahan"``; the others
    pass theirs through). Params wider than half take `inner`'s update as it is."""
    out_u, out_c = [], []
    for i, (p, u) in enumerate(zip(p_leaves, u_leaves)):
        if not is_half(p):
            out_u.append(u)
            if c_leaves is not None:
                out_c.append(c_leaves[i])
            continue
        p32, u32 = p.astype(_F32), u.astype(_F32)
        if mode == "stochastic":
            new = stochastic_round(jax.random.fold_in(key, i), p32 + u32, p.dtype)
        elif mode == "nearest":
            new = (p32 + u32).astype(p.dtype)
        else:
            master = _join(p, c_leaves[i]) + u32  # type: ignore[index]
            new, rest = _split(master, np.dtype(p.dtype))
            out_c.append(rest)
        out_u.append(new.astype(_F32) - p32)
    return out_u, out_c


def _stored_state(
    inner_state: Any, reference: Any, stored_dtype: Callable[[Any], np.dtype], key: Any
) -> Any:
    """`inner`'s float32 state with each leaf `stored_dtype` narrows rounded stochastically to
    it (see half_updates' state_dtype); `reference` is the state's float32 shapes."""
    s_leaves, s_def = jax.tree_util.tree_flatten(inner_state)
    r_leaves = up_to(s_def, reference)
    return jax.tree_util.tree_unflatten(
        s_def,
        [
            stochastic_round(jax.random.fold_in(key, i), s, stored_dtype(r))
            if is_float(s) and stored_dtype(r) != np.dtype(r.dtype)
            else s
            for i, (s, r) in enumerate(zip(s_leaves, r_leaves))
        ],
    )


def _stored_dtype(leaf: Any, state_dtype: np.dtype | None) -> np.dtype:
    """The dtype a leaf of the inner optimizer's state is kept in: `state_dtype` for float
    arrays wider than it."""
    dtype = np.dtype(leaf.dtype)
    if (
        state_dtype is not None
        and jnp.issubdtype(dtype, jnp.floating)
        and len(leaf.shape) >= 1
        and dtype.itemsize > state_dtype.itemsize
    ):
        return state_dtype
    return dtype


def _widen(params: Any) -> Any:
    """`params` with their half leaves in float32."""
    return jax.tree_util.tree_map(lambda p: p.astype(_F32) if is_half(p) else p, params)


def _wide(
    inner_tx: optax.GradientTransformation,
    treedef: Any,
    g_leaves: list[Any],
    stored_state: Any,
    p_leaves: list[Any],
) -> tuple[Any, Any, Any, Any]:
    """What the inner optimizer sees, all float32: (gradients, its state, params), and the
    state's dtypes as its init makes them (to store it back)."""
    wide_params = jax.tree_util.tree_unflatten(treedef, [_widen(p) for p in p_leaves])
    wide_grads = jax.tree_util.tree_unflatten(
        treedef,
        [g.astype(_F32) if is_half(p) and is_float(g) else g for g, p in zip(g_leaves, p_leaves)],
    )
    reference = jax.eval_shape(inner_tx.init, wide_params)
    inner_state = jax.tree_util.tree_map(
        lambda s, ref: s.astype(ref.dtype) if is_float(s) and s.dtype != ref.dtype else s,
        stored_state,
        reference,
    )
    return wide_grads, inner_state, wide_params, reference


def _split_key(key_data: Any, impl: Any) -> tuple[Any, Any, Any]:
    """(next step's key, the params' rounding key, the state's rounding key), or Nones where
    the state keeps no key (round to nearest)."""
    if key_data is None:
        return None, None, None
    new_key, param_key, state_key = jax.random.split(
        jax.random.wrap_key_data(key_data, impl=impl), 3
    )
    return new_key, param_key, state_key


def half_updates(
    inner: optax.GradientTransformation,
    mode: str = "stochastic",
    *,
    key: jax.Array | int = 0,
    state_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Updates half-precision params without a float32 master copy, without losing updates.

    Params stored in bfloat16 (or float16) and updated with round-to-nearest stall: an update
    smaller than half the gap between a weight and its neighbour (2**-9 of the weight in
    bfloat16) is lost whole, every step. This wrapper runs `inner` in float32 on the
    gradients, params and (upcast) optimizer state, and then puts ``params + update`` back
    into each param's dtype in one of three ways:

    * ``"stochastic"``: unbiased stochastic rounding (:func:`stochastic_round`), so small
      updates survive in expectation. Keyed: the key is kept and split in the state, and
      the same key gives the same run.
    * ``"kahan"``: compensated summation. Each param keeps, in a 16-bit buffer (int16), what
      rounding it to nearest dropped of its float32 sum, and adds it back on the next step:
      for bfloat16 the low 16 bits of the float32 value, so param and buffer are a float32
      master split in two, and the updates accumulate exactly as float32 ones do
      (float16: in its normal range). Deterministic; 2 bytes per param.
    * ``"nearest"``: round to nearest, the baseline that loses small updates (what plain
      optax on half params does), for comparison.

    The updates it returns are float32 and such that ``optax.apply_updates(params, updates)``
    gives the rounded params bit for bit, so it works wherever optax's updates do:
    ``nnx.Optimizer``, a Flax ``TrainState``, ``optax.MultiSteps``, :func:`mpjax.loss_scale`.
    (That holds unless one step shrinks a weight more than 2**15-fold in bfloat16, 2**12 in
    float16: the result is then within float32 rounding of the old weight; and a zero
    result comes back as +0.) It must make the last change to the updates, so wrap the whole
    optimizer, ``half_updates(optax.chain(clip, adamw))``, and put :func:`mpjax.loss_scale`
    and ``optax.MultiSteps`` outside it: ``mpjax.loss_scale(mpjax.half_updates(adam))``
    skips a non-finite step exactly (params, moments, buffer and key unchanged).

    Params in float32 (or wider) pass through untouched, with `inner`'s update, so a tree
    may mix half weights with float32 ones.

    Memory with Adam, per parameter: bfloat16 params 2 bytes, Adam's moments 8 in float32;
    ``optax.adam(..., mu_dtype=jnp.bfloat16)`` makes them 6, ``state_dtype="bfloat16"`` 4;
    ``"kahan"`` adds 2 (as many as a float32 master, but the params are usable bfloat16
    arrays, with no per-step cast). A float32 master copy (O2) costs 4 + 8 = 12 (apex O2,
    which also keeps a half copy, 14).

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``; it runs in float32.
      mode: ``"stochastic"`` (default), ``"kahan"`` or ``"nearest"``.
      key: PRNG key or int seed for stochastic rounding (default 0). Give each run of a
        multi-seed study its own. Replicas that share a state round alike, so data-parallel
        params stay identical.
      state_dtype: None keeps `inner`'s state as it makes it (float32 for Adam).
        ``"bfloat16"`` stores its float array leaves (Adam's moments, not its scalar count or
        hyperparameters) in bfloat16, rounded stochastically in every mode: to nearest,
        Adam's second moment with b2=0.999 could never decrease (its change per step, 1e-3,
        is below bfloat16's half gap, 2**-9). float16 is refused: squared gradients underflow.

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a
      :class:`HalfUpdatesState`.

    Raises:
      TypeError: if `inner` is not a GradientTransformation, or `key` not a key or seed.
      ValueError: for an unknown `mode` or `state_dtype`, a non-float param, or
        ``update`` called without ``params``.

    References:
      Zamirai et al., 2020, "Revisiting BFloat16 Training", https://arxiv.org/abs/2010.06192

      Kahan, 1965, "Further remarks on reducing truncation errors", Comm. ACM 8(1).

    Example:
      >>> import jax.numpy as jnp, optax, mpjax
      >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
      >>> grads = {"w": jnp.ones(4, jnp.bfloat16)}
      >>> for mode in ("nearest", "kahan"):
      ...     tx = mpjax.half_updates(optax.sgd(1e-3), mode)   # 1e-3 < bfloat16's gap at 1.0
      ...     p, state = params, tx.init(params)
      ...     for _ in range(100):
      ...         updates, state = tx.update(grads, state, p)
      ...         p = optax.apply_updates(p, updates)
      ...     print(mode, float(p["w"][0]), p["w"].dtype)   # exact: 0.9
      nearest 1.0 bfloat16
      kahan 0.8984375 bfloat16
    """
    inner_tx = check_inner(inner)
    mode = _check_mode(mode)
    state_dtype = _check_state_dtype(state_dtype)
    random = mode == "stochastic" or state_dtype is not None
    key_data, impl = key_and_impl(key)

    stored_dtype = functools.partial(_stored_dtype, state_dtype=state_dtype)

    def init(params: optax.Params) -> HalfUpdatesState:
        _check_half_params(params)
        inner_state = inner_tx.init(_widen(params))
        inner_state = jax.tree_util.tree_map(
            lambda s: s.astype(stored_dtype(s)) if is_float(s) else s, inner_state
        )
        compensation = None
        if mode == "kahan":
            compensation = jax.tree_util.tree_map(
                lambda p: jnp.zeros(p.shape if is_half(p) else [0], jnp.int16), params
            )
        return HalfUpdatesState(
            inner_state=inner_state,
            key=jnp.asarray(key_data) if random else None,
            compensation=compensation,
        )

    def update(
        updates: optax.Updates,
        state: HalfUpdatesState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, HalfUpdatesState]:
        p_leaves, treedef, g_leaves = _update_leaves(updates, state, params)
        wide_grads, inner_state, wide_params, reference = _wide(
            inner_tx, treedef, g_leaves, state.inner_state, p_leaves
        )
        inner_updates, inner_state = inner_tx.update(
            wide_grads, inner_state, wide_params, **extra_args
        )
        u_leaves = up_to(treedef, inner_updates)
        new_key, param_key, state_key = _split_key(state.key, impl)
        c_leaves = up_to(treedef, state.compensation) if state.compensation is not None else None
        out_u, out_c = _rounded_updates(mode, p_leaves, u_leaves, c_leaves, param_key)
        if state_dtype is not None:
            inner_state = _stored_state(inner_state, reference, stored_dtype, state_key)
        return jax.tree_util.tree_unflatten(treedef, out_u), HalfUpdatesState(
            inner_state=inner_state,
            key=None if new_key is None else jax.random.key_data(new_key),
            compensation=None if c_leaves is None else jax.tree_util.tree_unflatten(treedef, out_c),
        )

    return optax.GradientTransformationExtraArgs(init, update)
