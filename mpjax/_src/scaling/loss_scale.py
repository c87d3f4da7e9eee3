"""Loss scales as pytrees (jmp's `NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`) and
the finite-check helpers `all_finite` and `select_tree`."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.dtypes import is_inexact

T = TypeVar("T")


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _jax_dtype(value: Any) -> np.dtype | None:
    # The dtype jax gives a number (a Python int is int32), as jmp's warning reports it;
    # None for anything that is not a number or an array.
    if hasattr(value, "dtype"):
        return np.dtype(value.dtype)
    if isinstance(value, (int, float)):
        return np.dtype(jnp.result_type(value))
    return None


def _warn_if_not_floating(dtype: Any, name: str, stacklevel: int) -> None:
    # jmp's warn_if_not_floating, word for word: jmp accepts an integer scale with this warning.
    if not jnp.issubdtype(dtype, jnp.floating):
        warnings.warn(f"Expected floating type for {name}, got {dtype}", stacklevel=stacklevel)


def warn_if_not_floating(x: Any, var_name: str) -> None:
    """jmp's helper of that name (``jmp._src.loss_scale``), which public code imports."""
    _warn_if_not_floating(jnp.result_type(x), var_name, stacklevel=3)


def scalar_setting(
    value: Any,
    name: str,
    *,
    positive: bool = False,
    jmp_warning: bool = False,
    stacklevel: int = 3,
) -> float:
    """Returns a concrete, finite, non-negative number (a scale or a bound) as a Python float.

    Integers are accepted, as jmp accepts them. With `jmp_warning`, a non-float value warns
    as jmp's ``DynamicLossScale`` does ("Expected floating type for ...").

    Raises:
      TypeError: for a bool, a non-number, a non-scalar or a traced value.
      ValueError: for a NaN, infinite or negative value (or zero, with `positive`).
    """
    dtype = _jax_dtype(value)
    if isinstance(value, (bool, np.bool_)) or dtype is None or dtype == np.bool_:
        # jmp would take True as 1; a flag passed by mistake should not become a scale.
        raise TypeError(
            f"{name} must be a float, got {type(value).__name__} {value!r}; "
            "pass a number such as 2.0**15."
        )
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"{name} must be a float, got dtype {dtype}.")
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a concrete number, got a traced value; it is static "
            "configuration, so set it outside jax.jit."
        )
    if np.ndim(value) != 0:
        raise TypeError(f"{name} must be a scalar float, got shape {np.shape(value)}.")
    if jmp_warning:
        _warn_if_not_floating(dtype, name, stacklevel + 1)
    result = float(value)
    if positive and not (math.isfinite(result) and result > 0):
        raise ValueError(f"{name} must be a positive finite float, got {result}.")
    if not (math.isfinite(result) and result >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {result}.")
    return result


def _warn_if_zero(value: float, name: str, stacklevel: int) -> None:
    if value == 0:
        # jmp accepts a zero scale silently; it zeroes every loss, so every step would be skipped.
        warnings.warn(
            f"{name}=0 multiplies the loss by zero: every gradient unscales to nan and every "
            "step is skipped. Use a positive scale such as 2.0**15.",
            stacklevel=stacklevel,
        )


def check_scale_value(value: Any, name: str) -> float:
    """Returns a loss-scale setting as a positive Python float, or raises a clear error.

    An int is accepted and converted (``1024`` gives ``1024.0``).

    Raises:
      TypeError: for a bool, a non-numeric, non-scalar or traced value.
      ValueError: for a non-finite or non-positive value.
    """
    return scalar_setting(value, name, positive=True)


def _wide(x: Any) -> Any:
    # Promote explicitly (works under jax_numpy_dtype_promotion="strict"): half -> float32.
    return x.astype(jnp.float32) if jnp.finfo(x.dtype).bits < 32 else x


def _python_float_as_array(x: Any) -> Any:
    # A Python float loss (`scale.scale(1.5)`) is scaled as jmp scales it, as a float32
    # array; left alone it came back unscaled, silently.
    return jnp.asarray(x, jnp.float32) if isinstance(x, float) else x


def _scale_tree(tree: T, factor: Any) -> T:
    # As jmp: a half leaf times the float32 scale gives float32, so a scaled half loss
    # cannot overflow before the backward pass starts.
    def scale(x: Any) -> Any:
        x = _python_float_as_array(x)
        return _wide(x) * factor if is_inexact(x) else x

    return jax.tree_util.tree_map(scale, tree)


def _unscale_tree(tree: T, loss_scale: Any, *, divide: bool = False) -> T:
    scale = jnp.asarray(loss_scale, jnp.float32)
    inv = None if divide else 1.0 / scale

    def unscale(x):
        x = _python_float_as_array(x)
        if not is_inexact(x):
            return x
        # Unlike jmp (which returns float32 for half leaves), keep each leaf's dtype so that
        # optimizer state dtypes stay stable from step to step. The public unscale methods
        # multiply by the reciprocal, as jmp does, so a drop-in gives jmp's bits for any
        # scale (a divide differs by an ulp for a scale like 3). divide=True is for the
        # optax transformation: the same bits for a power-of-two scale (every dynamic one),
        # and XLA fuses a divide into the optimizer's update where a multiply by a computed
        # reciprocal made it keep a gradient-sized buffer, where Flax's DynamicScale divides
        # (docs/guides/internals.md has the measurement).
        wide = _wide(x)
        return (wide / scale if inv is None else wide * inv).astype(x.dtype)

    return jax.tree_util.tree_map(unscale, tree)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """A loss scale that does nothing: the choice for float32 and bfloat16.

    A pytree with no leaves.

    Example:
      >>> import mpjax
      >>> mpjax.NoOpLossScale().scale(3.0)
      3.0
    """

    @property
    def loss_scale(self) -> int:
        """Always 1, as jmp.

        Example:
          >>> import mpjax
          >>> mpjax.NoOpLossScale().loss_scale
          1
        """
        return 1

    def scale(self, tree: T) -> T:
        """Returns `tree` unchanged.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> loss = jnp.float16(2.0)
          >>> mpjax.NoOpLossScale().scale(loss) is loss
          True
        """
        return tree

    def unscale(self, tree: T) -> T:
        """Returns `tree` unchanged.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
          >>> mpjax.NoOpLossScale().unscale(grads) is grads
          True
        """
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """Returns self.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> ls = mpjax.NoOpLossScale()
          >>> ls.adjust(jnp.array(False)) is ls
          True
        """
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True, init=False)
class StaticLossScale:
    """Scales and unscales by a fixed constant.

    A pytree with no leaves: the scale is static configuration (a Python float), so it is
    part of the tree structure and survives any ``tree_map``.

    Args:
      loss_scale: a finite, non-negative number. An int is accepted and stored as a float, as
        jmp accepts it (``StaticLossScale(2)``); zero is accepted, as jmp does, with a warning
        (it would skip every step).

    Raises:
      TypeError: for a bool, a non-number, an array that is not a scalar, or a traced value.
      ValueError: for a NaN, infinite or negative scale.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> ls = mpjax.StaticLossScale(128)
      >>> ls.loss_scale
      128.0
      >>> float(ls.unscale(ls.scale(jnp.float32(0.5))))
      0.5
    """

    loss_scale: float

    def __init__(self, loss_scale: Any):
        value = scalar_setting(loss_scale, "loss_scale")
        _warn_if_zero(value, "loss_scale", stacklevel=3)
        object.__setattr__(self, "loss_scale", value)

    def scale(self, tree: T) -> T:
        """Multiplies the floating leaves of `tree` by the scale (in float32).

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> loss = mpjax.StaticLossScale(1024.0).scale(jnp.float16(0.5))
          >>> loss.dtype, loss.item()   # half widened to float32, so it cannot overflow
          (dtype('float32'), 512.0)
        """
        return _scale_tree(tree, jnp.float32(self.loss_scale))

    def unscale(self, tree: T) -> T:
        """Unscales the floating leaves of `tree` (times 1/scale, as jmp), keeping dtypes.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> ls = mpjax.StaticLossScale(1024.0)
          >>> grads = ls.unscale({"w": jnp.full(2, 512.0, jnp.float16)})
          >>> grads["w"].dtype, grads["w"].tolist()
          (dtype('float16'), [0.5, 0.5])
        """
        return _unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """Returns self: a static scale never changes.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> ls = mpjax.StaticLossScale(1024.0)
          >>> ls.adjust(jnp.array(False)) is ls, ls.loss_scale
          (True, 1024.0)
        """
        del grads_finite
        return self


jax.tree_util.register_pytree_node(
    NoOpLossScale, lambda x: ((), None), lambda aux, children: NoOpLossScale()
)


def _static_unflatten(aux: float, children: Any) -> StaticLossScale:
    del children
    new = object.__new__(StaticLossScale)  # the value was checked when it was first built
    object.__setattr__(new, "loss_scale", aux)
    return new


jax.tree_util.register_pytree_node(StaticLossScale, lambda x: ((), x.loss_scale), _static_unflatten)


def _check_period(period: Any) -> int:
    # jmp takes any number (its own tests pass period=5.0); a whole float is a whole period.
    if isinstance(period, (int, np.integer)) and not isinstance(period, (bool, np.bool_)):
        value = int(period)
    elif isinstance(period, (float, np.floating)) and float(period).is_integer():
        value = int(period)
    else:
        value = 0
    if value < 1:
        raise ValueError(
            f"period must be an int >= 1 (a whole float such as 5.0 is accepted), got {period!r}."
        )
    return value


_STATIC_FIELDS = (
    "period",
    "factor",
    "min_loss_scale",
    "growth_factor",
    "backoff_factor",
    "hysteresis",
    "max_loss_scale",
)


def _check_start(loss_scale: Any) -> None:
    """DynamicLossScale's first scale: warns as jmp does (zero, an int) at the user's line."""
    if _is_concrete(loss_scale):
        value = scalar_setting(loss_scale, "loss_scale", jmp_warning=True, stacklevel=4)
        _warn_if_zero(value, "loss_scale", 4)
    elif jnp.issubdtype(loss_scale.dtype, jnp.integer):
        _warn_if_not_floating(loss_scale.dtype, "loss_scale", 4)
    elif not jnp.issubdtype(loss_scale.dtype, jnp.floating):
        raise TypeError(f"loss_scale must be a float, got dtype {loss_scale.dtype}.")


def _check_factors(factor: Any, growth_factor: Any, backoff_factor: Any) -> float:
    """The growth factor (torch's `growth_factor`, else jmp's `factor`), after checking that
    the scale can grow back and shrink on overflow."""
    factor_f = float(factor)
    growth = float(growth_factor) if growth_factor is not None else factor_f
    if not math.isfinite(growth) or growth <= 1:
        raise ValueError(
            f"growth factor must be > 1 (the scale has to grow back), got {growth}; "
            "torch and jmp use 2."
        )
    if backoff_factor is None:
        if not factor_f > 1:
            raise ValueError(f"factor must be > 1, got {factor_f}; jmp and torch use 2.")
    elif not 0 < float(backoff_factor) < 1:
        raise ValueError(
            f"backoff_factor must be in (0, 1) (the scale has to shrink on overflow), got "
            f"{backoff_factor}; torch uses 0.5."
        )
    return growth


def _check_range(scale: Any, min_f: float, max_f: float) -> None:
    """The bounds hold each other and a known first scale."""
    if not max_f >= min_f:
        raise ValueError(f"max_loss_scale ({max_f}) must be >= min_loss_scale ({min_f}).")
    if _is_concrete(scale) and float(scale) > max_f:
        raise ValueError(
            f"loss_scale {float(scale)} is above max_loss_scale {max_f}; "
            "raise max_loss_scale or start lower."
        )
    if _is_concrete(scale) and 0 < float(scale) < min_f:
        # jmp accepts this, and its first overflow then raises the scale to the minimum.
        raise ValueError(
            f"min_loss_scale {min_f} is above loss_scale {float(scale)}: an overflow "
            "would raise the scale to the minimum instead of lowering it. Start at or "
            "above the minimum, or lower min_loss_scale."
        )


@dataclasses.dataclass(frozen=True, init=False)
class DynamicLossScale:
    """Dynamic loss scaling: the largest scale that keeps gradients finite.

    jmp's rule by default: after `period` consecutive finite steps the scale grows by
    `factor`; on a non-finite step it shrinks by `factor` (not below `min_loss_scale`) and the
    counter restarts. Beyond jmp, the knobs of torch's GradScaler, PaddlePaddle and
    DeepSpeed: separate growth and backoff factors, hysteresis (back off only on the
    `hysteresis`-th consecutive overflow, Paddle's ``decr_every_n_nan_or_inf``) and a
    maximum (growth is capped, so the scale is never inf; apex caps at 2**24).

    The pytree leaves are the scale (float32) and the counter (int32), as jmp's, plus the
    overflow counter when ``hysteresis > 1``. Every other field is static and survives
    ``tree_map``, ``jit``, ``.lower()``, ``vmap`` and pickling (jmp loses ``min_loss_scale``).

    Args:
      loss_scale: the initial scale, a finite non-negative number, kept in float32 (so a
        float16 value works). As jmp, an integer is accepted with jmp's warning "Expected
        floating type for loss_scale", and zero is accepted (with a warning: no step would
        ever be finite).
      counter: consecutive finite steps so far (int32).
      period: finite steps between growths (torch's ``growth_interval``); an int, or a whole
        float such as ``5.0`` (jmp accepts it).
      factor: jmp's single factor: grow by it, back off by ``1 / factor``.
      min_loss_scale: the scale never backs off below this; ``0.0`` means no floor, as
        torch's GradScaler. An integer warns as jmp does ("Expected floating type for
        min_loss_scale").
      growth_factor: growth factor (default `factor`); must be > 1.
      backoff_factor: backoff multiplier (default ``1 / factor``); must be in (0, 1).
      hysteresis: back off on this many consecutive non-finite steps (default 1).
      max_loss_scale: growth is capped here (default 2**24, apex's cap).
      bad_steps: consecutive non-finite steps so far (only with ``hysteresis > 1``).

    References:
      Micikevicius et al., 2018, "Mixed Precision Training", https://arxiv.org/abs/1710.03740

    Raises:
      TypeError: for a bool, non-numeric, non-scalar or traced setting.
      ValueError: for a NaN, infinite or negative scale or bound, a minimum above the
        initial scale or the maximum, or a knob out of range.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> ls = mpjax.DynamicLossScale(2.0**15, period=2)
      >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))   # two finite steps
      >>> float(ls.loss_scale)
      65536.0
      >>> float(ls.adjust(jnp.array(False)).loss_scale)              # an overflow
      32768.0
    """

    loss_scale: jax.Array
    counter: jax.Array
    period: int
    factor: float
    min_loss_scale: float
    growth_factor: float
    backoff_factor: float | None
    hysteresis: int
    max_loss_scale: float
    bad_steps: jax.Array | None

    def __init__(  # noqa: PLR0913 (jmp's arguments, then torch.amp's keyword options)
        self,
        loss_scale: Any,
        counter: Any = None,
        period: int = 2000,
        factor: float = 2,
        min_loss_scale: Any = 1.0,
        *,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        hysteresis: int = 1,
        max_loss_scale: float = 2.0**24,
        bad_steps: Any = None,
    ):
        _check_start(loss_scale)
        min_f = scalar_setting(min_loss_scale, "min_loss_scale", jmp_warning=True)
        period_i = _check_period(period)
        if not isinstance(hysteresis, (int, np.integer)) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}.")
        growth = _check_factors(factor, growth_factor, backoff_factor)
        max_f = float(max_loss_scale)
        scale_f32 = jnp.asarray(loss_scale, jnp.float32)
        _check_range(scale_f32, min_f, max_f)
        values = {
            "loss_scale": scale_f32,
            "counter": jnp.asarray(0 if counter is None else counter, jnp.int32),
            "period": period_i,
            "factor": factor,
            "min_loss_scale": min_f,
            "growth_factor": growth,
            "backoff_factor": None if backoff_factor is None else float(backoff_factor),
            "hysteresis": int(hysteresis),
            "max_loss_scale": max_f,
            "bad_steps": (
                jnp.asarray(0 if bad_steps is None else bad_steps, jnp.int32)
                if hysteresis > 1
                else None
            ),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def scale(self, tree: T) -> T:
        """Multiplies the floating leaves of `tree` (usually the loss) by the scale.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> loss = mpjax.DynamicLossScale(2.0**15).scale(jnp.float16(2.0))
          >>> loss.dtype, loss.item()   # half widened to float32, so it cannot overflow
          (dtype('float32'), 65536.0)
        """
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Unscales the floating leaves of `tree` (usually grads): times 1/scale, as jmp.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> ls = mpjax.DynamicLossScale(2.0**15)
          >>> grads = ls.unscale({"w": jnp.full(2, 2.0**14, jnp.float16)})
          >>> grads["w"].dtype, grads["w"].tolist()
          (dtype('float16'), [0.5, 0.5])
        """
        return _unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """Returns the next state given whether this step's gradients were finite.

        Args:
          grads_finite: a boolean scalar, e.g. ``mpjax.all_finite(grads)``.

        Returns:
          The new DynamicLossScale (same structure and dtypes, so jit does not retrace).

        Raises:
          TypeError: if `grads_finite` is a tree (the gradients) instead of the flag.
          ValueError: if `grads_finite` is not a scalar.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> ls = mpjax.DynamicLossScale(2.0**15, period=1)
          >>> ls.adjust(mpjax.all_finite({"g": jnp.ones(2)})).loss_scale.item()
          65536.0
          >>> ls.adjust(mpjax.all_finite({"g": jnp.array([1.0, jnp.inf])})).loss_scale.item()
          16384.0
        """
        if not hasattr(grads_finite, "shape") and not isinstance(
            grads_finite, (bool, int, float, np.bool_, np.number)
        ):
            raise TypeError(
                "adjust takes whether this step's gradients were finite, a boolean scalar, "
                f"not a {type(grads_finite).__name__}: pass mpjax.all_finite(grads), not the "
                "gradients themselves."
            )
        finite = jnp.asarray(grads_finite)
        if finite.ndim != 0:
            raise ValueError(
                f"adjust expects a boolean scalar, got shape {finite.shape}; "
                "pass mpjax.all_finite(grads)."
            )
        finite = finite.astype(jnp.bool_)
        scale = self.loss_scale
        grown = scale * jnp.float32(self.growth_factor)
        # jmp keeps the old scale when growth overflows to inf; we also cap at the maximum.
        grown = jnp.minimum(jnp.where(jnp.isfinite(grown), grown, scale), self.max_loss_scale)
        on_finite = jnp.where(self.counter == self.period - 1, grown, scale)
        if self.backoff_factor is None:
            backed = scale / jnp.float32(self.factor)  # jmp divides; keep its rounding exactly
        else:
            backed = scale * jnp.float32(self.backoff_factor)
        backed = jnp.maximum(jnp.float32(self.min_loss_scale), backed)
        counter = jnp.where(finite, (self.counter + 1) % self.period, 0).astype(jnp.int32)

        bad_steps = None
        if self.bad_steps is not None:  # hysteresis > 1: Paddle's decr_every_n_nan_or_inf
            bad = jnp.where(finite, 0, self.bad_steps + 1)
            back_off_now = jnp.logical_and(jnp.logical_not(finite), bad >= self.hysteresis)
            backed = jnp.where(back_off_now, backed, scale)
            bad_steps = jnp.where(back_off_now, 0, bad).astype(jnp.int32)
        new_scale = jnp.where(finite, on_finite, backed).astype(jnp.float32)
        leaves = [new_scale, counter] + ([] if bad_steps is None else [bad_steps])
        return _dynamic_unflatten(_dynamic_flatten(self)[1], leaves)


def _dynamic_flatten(x: DynamicLossScale) -> tuple[list[Any], tuple]:
    leaves = [x.loss_scale, x.counter] + ([x.bad_steps] if x.hysteresis > 1 else [])
    return leaves, tuple(getattr(x, name) for name in _STATIC_FIELDS)


def _dynamic_flatten_with_keys(x: DynamicLossScale) -> tuple[list[Any], tuple]:
    leaves, aux = _dynamic_flatten(x)
    names = ("loss_scale", "counter", "bad_steps")
    return [(jax.tree_util.GetAttrKey(n), v) for n, v in zip(names, leaves)], aux


def _dynamic_unflatten(aux: tuple, children: Any) -> DynamicLossScale:
    # Bypasses __init__: after a tree_map the leaves may be tracers, ShapeDtypeStructs or None.
    new = object.__new__(DynamicLossScale)
    for name, value in zip(_STATIC_FIELDS, aux, strict=True):
        object.__setattr__(new, name, value)
    children = list(children)
    object.__setattr__(new, "loss_scale", children[0])
    object.__setattr__(new, "counter", children[1])
    object.__setattr__(new, "bad_steps", children[2] if len(children) > 2 else None)
    return new


jax.tree_util.register_pytree_with_keys(
    DynamicLossScale, _dynamic_flatten_with_keys, _dynamic_unflatten, flatten_func=_dynamic_flatten
)

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
LOSS_SCALE_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


def all_finite(tree: Any) -> jax.Array:
    """Returns a boolean scalar: whether every floating leaf of `tree` is finite.

    Integer and boolean leaves are always finite; an empty tree is finite (as jmp).

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> bool(mpjax.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_inexact(x)]
    if not leaves:
        return jnp.array(True)
    # Leaves of one shape and dtype (a layer's kernels, repeated in every block) are checked
    # by one reduction over their elementwise max (inf and NaN both carry through it): one
    # kernel per group instead of per leaf (a 12-layer model has about 15 groups for its 150
    # leaves), reading each leaf where it is, with each leaf's sharding. (A reduction over
    # their stack fuses as well on a GPU, but a TPU writes the stack: one more write and
    # read of every gradient.)
    groups: dict[Any, list[Any]] = {}
    for x in leaves:
        groups.setdefault((jnp.shape(x), jnp.result_type(x)), []).append(x)
    peaks = [functools.reduce(jnp.maximum, [jnp.abs(x) for x in g]) for g in groups.values()]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(p)) for p in peaks]))


def leaf_finite_flags(tree: Any) -> jax.Array:
    """Returns one boolean per floating leaf of `tree` (in tree_leaves order): all finite?"""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_inexact(x)]
    if not leaves:
        return jnp.zeros([0], jnp.bool_)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def select_tree(pred: Any, a: T, b: T) -> T:
    """Selects tree `a` where `pred` is True, else `b` (leafwise ``lax.select``), as jmp.

    Args:
      pred: a boolean scalar.
      a: the tree to take where `pred` holds.
      b: a tree of the same structure, taken otherwise.

    Raises:
      AssertionError: as jmp, if `pred` is not a boolean scalar.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> mpjax.select_tree(jnp.array(False), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})["x"]
      Array([0., 0.], dtype=float32)
    """
    sa, sb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if sa != sb:  # type: ignore[operator]
        raise ValueError(f"select_tree needs two trees of the same structure, got {sa} and {sb}.")
    pred = jnp.asarray(pred)
    assert pred.ndim == 0 and pred.dtype == jnp.bool_, (
        f"expected boolean scalar, got dtype {pred.dtype} shape {pred.shape}"
    )
    return jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)


def divide_by_scale(loss_scale: Any, tree: T) -> T:
    """`loss_scale.unscale(tree)`, dividing by the scale where jmp multiplies by 1/scale.

    For the optax transformation: see `_unscale_tree` for why it divides.
    """
    if isinstance(loss_scale, (StaticLossScale, DynamicLossScale)):
        return _unscale_tree(tree, loss_scale.loss_scale, divide=True)
    return loss_scale.unscale(tree)
