"""Loss scaling as an optax transformation: `loss_scale`, its state, `get_loss_scale` and
`loss_scale_metrics`."""

from __future__ import annotations

import os
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpjax._src.deprecations import renamed
from mpjax._src.dtypes import is_half, is_inexact
from mpjax._src.optim.half_params import arrays_of, check_inner
from mpjax._src.scaling import loss_scale as ls_lib


class NonFiniteLeaves:
    """Which float leaves of the last step's gradients were non-finite.

    A pytree whose only leaf is ``mask`` (bool, one entry per float gradient leaf); the leaf
    paths are static. Made by ``loss_scale(..., track_nonfinite=True)``.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> mpjax.NonFiniteLeaves(jnp.array([False, True]), ("['a']", "['b']")).names()
      ["['b']"]
    """

    def __init__(self, mask: Any, paths: tuple[str, ...]):
        self.mask = mask
        self.paths = paths

    def __repr__(self) -> str:
        return f"NonFiniteLeaves(mask={self.mask!r}, paths={self.paths!r})"

    def names(self) -> list[str]:
        """The paths of the non-finite leaves (host-side: needs a concrete mask).

        Example:
          >>> import jax.numpy as jnp, optax, mpjax
          >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
          >>> tx = mpjax.loss_scale(optax.sgd(0.1), track_nonfinite=True)
          >>> grads = {"a": jnp.ones(2), "b": jnp.array([1.0, jnp.nan])}
          >>> _, state = tx.update(grads, tx.init(params), params)
          >>> state.nonfinite.names()
          ["['b']"]
        """
        mask = jax.device_get(self.mask)
        return [p for p, bad in zip(self.paths, mask, strict=True) if bad]


jax.tree_util.register_pytree_with_keys(
    NonFiniteLeaves,
    lambda x: (((jax.tree_util.GetAttrKey("mask"), x.mask),), x.paths),
    lambda paths, children: NonFiniteLeaves(list(children)[0], paths),
    flatten_func=lambda x: ((x.mask,), x.paths),
)


def _float_leaf_paths(tree: Any) -> tuple[str, ...]:
    return tuple(
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if is_inexact(x)
    )


class LossScaleState(NamedTuple):
    """State of :func:`loss_scale`.

    Attributes:
      loss_scale: the current loss scale (a NoOp, Static or DynamicLossScale pytree).
      skipped_steps: int32, non-finite steps skipped since init.
      consecutive_skips: int32, non-finite steps skipped in a row up to now.
      last_finite: bool, whether the last step's gradients were finite.
      inner_state: the wrapped optimizer's state (``optax.EmptyState()`` in the chain form).
      nonfinite: which gradient leaves were non-finite on the last step (a
        :class:`NonFiniteLeaves`), or None unless ``track_nonfinite=True``.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> state = mpjax.loss_scale().init({"w": jnp.ones(2)})
      >>> type(state).__name__, int(state.skipped_steps), bool(state.last_finite)
      ('LossScaleState', 0, True)
    """

    loss_scale: ls_lib.LossScale
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    last_finite: jax.Array
    inner_state: optax.OptState
    nonfinite: NonFiniteLeaves | None = None


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs | None:
    if inner is None:
        return None
    if isinstance(inner, (int, float)) or isinstance(inner, ls_lib.LOSS_SCALE_TYPES):
        raise TypeError(
            f"loss_scale(inner) takes an optax GradientTransformation, got {inner!r}. To set "
            "the scale, pass it by keyword: mpjax.loss_scale(scale=mpjax.StaticLossScale(1024.0))."
        )
    return check_inner(inner, "loss_scale")


def _check_has_floats(tree: Any, what: str) -> None:
    if not any(is_inexact(x) for x in jax.tree_util.tree_leaves(tree)):
        raise ValueError(
            f"loss_scale(): {what} has no floating-point arrays, so there is nothing to scale or "
            "check. Pass the model's float parameters/gradients (integer leaves are left alone)."
        )


def _check_like_params(grads: Any, params: Any) -> None:
    gs, ps = jax.tree_util.tree_structure(grads), jax.tree_util.tree_structure(params)
    if gs != ps:  # type: ignore[operator]
        raise ValueError(
            "loss_scale(): the gradients and params have different tree structures "
            f"({gs} vs {ps}); pass jax.grad's output for these params."
        )
    for (path, g), p in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree_util.tree_leaves(params)
    ):
        if np.shape(g) != np.shape(p):
            raise ValueError(
                f"loss_scale(): gradient {jax.tree_util.keystr(path)} has shape {np.shape(g)} "
                f"but its param has shape {np.shape(p)}."
            )


def _scale_at_least_one(scale: ls_lib.LossScale) -> bool:
    if isinstance(scale, ls_lib.DynamicLossScale):
        return scale.min_loss_scale >= 1.0
    if isinstance(scale, ls_lib.StaticLossScale):
        return scale.loss_scale >= 1.0
    return True


def loss_scale(
    inner: optax.GradientTransformation | None = None,
    *,
    scale: ls_lib.LossScale | None = None,
    track_nonfinite: bool = False,
    axis_name: str | tuple[str, ...] | None = None,
    check_updates: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Loss scaling as an optax transformation: unscale, check finite, skip, adjust.

    The incoming gradients are those of the *scaled* loss (``scale.scale(loss)``, with the
    scale from :func:`get_loss_scale`). Each update unscales them with the scale that produced
    them, checks that every float leaf is finite, adjusts the scale, and on a non-finite step
    emits zero updates (``-0.0``, so ``params + update`` is bit-identical to ``params``).

    Two forms:

    * wrap form, ``mpjax.loss_scale(optax.chain(optax.clip_by_global_norm(1.0),
      optax.adamw(1e-3)))``: the inner optimizer sees unscaled gradients; on a skipped step
      its result is selected away, so the params and every leaf of its state stay
      bit-identical (as ``optax.apply_if_finite``). Exact for any optimizer: use it for
      anything stateful.
    * chain form, ``optax.chain(mpjax.loss_scale(), optax.sgd(0.1))``: transformations after
      it see unscaled gradients, and zeros on a skipped step. Exact only when they are
      stateless (sgd without momentum, clipping, a constant learning rate). A stateful one
      (adam, momentum, a schedule's count) would still advance its state with zero
      gradients and move the params, so :func:`get_loss_scale` and
      :func:`loss_scale_metrics` warn (:class:`InexactSkipWarning`, once per state
      structure) when they find one after ``loss_scale()`` in a chain. optax's chain gives a
      transformation no way to stop the ones after it, so this form cannot be made exact.
      A stateful one *before* it sees the scaled gradients unchecked: one non-finite step
      puts inf into its state and every later step is skipped; they warn of that too.

    For gradient accumulation wrap ``optax.MultiSteps``: ``mpjax.loss_scale(optax.MultiSteps(
    optax.adam(1e-3), k))`` skips an overflowing microbatch without poisoning the accumulator
    (plain MultiSteps keeps a NaN forever, since ``0 * nan = nan``).

    Args:
      inner: optional optimizer to wrap (the wrap form); None for the chain form.
      scale: initial loss scale; default ``DynamicLossScale(2.0**15)``. Use
        ``policy.loss_scale()`` for the one a policy implies (none for bfloat16).
      track_nonfinite: record which gradient leaves were non-finite on the last step
        (:func:`nonfinite_leaves` names them). It reuses the per-leaf flags of the finite
        check, so it costs one small boolean array.
      check_updates: wrap form only: also check that the inner optimizer's updates are
        finite, and skip (and count) a step whose updates are not, even when its gradients
        were. Half params can make a non-finite update from finite gradients (float16 Adam:
        ``eps=1e-8`` rounds to zero, so a zero second moment divides by zero). Default
        (None): on exactly when a float param leaf is float16 or bfloat16, since the check
        reads every update once more. The loss scale still adjusts on the gradients alone:
        a smaller scale cannot mend such an update.
      axis_name: under ``pmap``/``shard_map`` with gradients that are *not* all-reduced
        before this transformation, the mapped axis (or axes) to combine the finite check
        over, so that every replica skips together. Not needed after an all-reduce (e.g.
        :func:`all_reduce_gradients`) or under ``jax.jit`` with sharded arrays, where the
        gradients are global.

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a :class:`LossScaleState`.

    Raises:
      TypeError: if `inner` is not a GradientTransformation or `scale` not a loss scale.

    References:
      Micikevicius et al., 2018, "Mixed Precision Training", https://arxiv.org/abs/1710.03740

    Example:
      >>> import jax, jax.numpy as jnp, optax, mpjax
      >>> tx = optax.chain(mpjax.loss_scale(), optax.sgd(0.1))
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> scale = mpjax.get_loss_scale(state)
      >>> grads = jax.grad(lambda p: scale.scale(jnp.sum(p["w"] ** 2)))(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"]
      Array([-0.2, -0.2, -0.2], dtype=float32)
    """
    inner_tx = _check_inner(inner)
    if scale is None:
        scale = ls_lib.DynamicLossScale(jnp.float32(2.0**15))
    if not isinstance(scale, ls_lib.LOSS_SCALE_TYPES):
        raise TypeError(
            f"scale must be a NoOpLossScale, StaticLossScale or DynamicLossScale, got "
            f"{scale!r}; e.g. scale=mpjax.DynamicLossScale(2.0**15) or scale=policy.loss_scale()."
        )
    initial_scale = scale
    if check_updates and inner_tx is None:
        raise ValueError(
            "loss_scale(check_updates=True) checks the updates of the optimizer it wraps, and "
            "the chain form wraps none: pass it, e.g. mpjax.loss_scale(optax.adam(1e-3), "
            "check_updates=True)."
        )

    def init(params: optax.Params) -> LossScaleState:
        return _initial_state(params, inner_tx, initial_scale, track_nonfinite)

    def update(
        updates: optax.Updates,
        state: LossScaleState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaleState]:
        _check_update_args(updates, state, params)
        updates = _apart_from_their_reductions(updates)
        # Unscale with the scale that produced these gradients, then adjust (jmp users often
        # adjust first and unscale with the new scale, which is off by the factor).
        grads = ls_lib.divide_by_scale(state.loss_scale, updates)
        # With a scale >= 1 (known statically), unscaling cannot overflow, so the raw
        # gradients are finite exactly when the unscaled ones are. Checking the raw ones
        # leaves the unscale multiply a single consumer, which XLA fuses into the update
        # instead of writing the unscaled gradients out (docs/guides/internals.md).
        checked = updates if _scale_at_least_one(state.loss_scale) else grads
        finite, nonfinite = _finite(checked, state.nonfinite, axis_name)
        new_scale = state.loss_scale.adjust(finite)
        if inner_tx is None:
            new_updates, inner_state = grads, state.inner_state
        else:
            check = _checks_updates(check_updates, params if params is not None else updates)
            new_updates, inner_state, finite = _inner_step(
                inner_tx, grads, state.inner_state, params, finite, check, extra_args
            )
        return _skipped_as_zero(finite, new_updates), _next_state(
            state, finite, new_scale, inner_state, nonfinite
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _check_update_args(updates: Any, state: Any, params: Any) -> None:
    if not isinstance(state, LossScaleState):
        raise TypeError(
            f"loss_scale().update got a state of type {type(state).__name__}; pass the state "
            "that this transformation's init returned."
        )
    _check_has_floats(updates, "the gradient tree")
    if params is not None:
        _check_like_params(updates, params)


def _apart_from_their_reductions(updates: Any) -> Any:
    """`updates` with its vector leaves (biases, norm scales) behind an optimization barrier:
    XLA groups the backward pass's reductions that make them by their consumers, and the
    finite check, one more, regrouped a BatchNorm's (a CNN's step: 50 gradient reads more
    than plain Adam in the H100 program, 0.5 behind the barrier). Matrices come from gemm
    and convolution calls, whose grouping no consumer changes."""
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    at = [i for i, x in enumerate(leaves) if is_inexact(x) and jnp.ndim(x) <= 1]
    if not at:
        return updates
    apart = jax.lax.optimization_barrier([leaves[i] for i in at])
    for i, x in zip(at, apart, strict=True):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _inner_step(
    inner_tx: Any, grads: Any, inner: Any, params: Any, finite: Any, check: bool, extra: Any
) -> tuple[Any, Any, jax.Array]:
    """The inner optimizer's update of the unscaled gradients, and its state where the step
    is finite, else its state unchanged: a select, where optax.apply_if_finite branches with
    lax.cond (a select fuses into the update, where a cond's branches keep their own
    buffers: docs/guides/internals.md). ``select(finite, new, old)`` returns `old` bit for
    bit, NaNs in `new` or not. With `check`, a step whose updates are not finite is skipped
    like an overflow, and counted, so no inf or NaN reaches the params."""
    updates, proposed = inner_tx.update(grads, inner, params, **extra)
    if check:
        finite = finite & ls_lib.all_finite(updates)
    kept = jax.tree_util.tree_map(
        lambda new, old: _select(finite, new, jnp.asarray(old, new.dtype)), proposed, inner
    )
    updates = jax.tree_util.tree_map(
        lambda u: u if is_inexact(u) else _select(finite, u, jnp.zeros_like(u)), updates
    )
    return updates, kept, finite


def _skipped_as_zero(finite: jax.Array, updates: Any) -> Any:
    """`updates`, or -0.0 for each floating leaf on a skipped step: p + (-0.0) == p bitwise
    for every p, including p == -0.0 (0.0 would turn it into +0.0)."""

    def mask(u: Any) -> Any:
        return _select(finite, u, jax.lax.full_like(u, -0.0)) if is_inexact(u) else u

    return jax.tree_util.tree_map(mask, updates)


def _next_state(
    state: LossScaleState, finite: jax.Array, scale: Any, inner: Any, nonfinite: Any
) -> LossScaleState:
    """The state after a step: its counters move by whether it was finite."""
    return LossScaleState(
        loss_scale=scale,
        skipped_steps=jnp.where(
            finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)
        ),
        consecutive_skips=jnp.where(finite, 0, state.consecutive_skips + 1).astype(jnp.int32),
        last_finite=finite,
        inner_state=inner,
        nonfinite=nonfinite,
    )


def _initial_state(
    params: Any,
    inner_tx: optax.GradientTransformation | None,
    scale: ls_lib.LossScale,
    track_nonfinite: bool,
) -> LossScaleState:
    """loss_scale's init: no step skipped yet, and `inner_tx`'s state."""
    _check_has_floats(params, "params")
    if inner_tx is not None:
        _warn_half_adam_eps(params, inner_tx)
    nonfinite = None
    if track_nonfinite:
        paths = _float_leaf_paths(params)
        nonfinite = NonFiniteLeaves(jnp.zeros([len(paths)], jnp.bool_), paths)
    return LossScaleState(
        loss_scale=scale,
        skipped_steps=jnp.zeros([], jnp.int32),
        consecutive_skips=jnp.zeros([], jnp.int32),
        last_finite=jnp.array(True),
        inner_state=optax.EmptyState() if inner_tx is None else inner_tx.init(params),
        nonfinite=nonfinite,
    )


def _finite(
    checked: Any, tracked: NonFiniteLeaves | None, axis_name: Any
) -> tuple[jax.Array, NonFiniteLeaves | None]:
    """Whether every leaf of `checked` is finite on every replica of `axis_name`, and, where
    `tracked` (loss_scale(track_nonfinite=True)'s state), which leaves were not."""

    def everywhere(ok: jax.Array) -> jax.Array:
        if axis_name is None:
            return ok
        # every replica sees every replica's overflow
        return jax.lax.psum(jnp.logical_not(ok).astype(jnp.int32), axis_name) == 0

    if tracked is None:  # one flag: a reduction per group of like leaves
        return everywhere(ls_lib.all_finite(checked)), None
    # a flag per leaf, to name the leaves that overflowed
    flags = everywhere(ls_lib.leaf_finite_flags(checked))
    if flags.shape != tracked.mask.shape:
        raise ValueError(
            f"loss_scale(track_nonfinite=True): the gradients have {flags.shape[0]} "
            f"float leaves but params had {tracked.mask.shape[0]}; pass "
            "gradients with the structure of the params given to init."
        )
    return jnp.all(flags), NonFiniteLeaves(jnp.logical_not(flags), tracked.paths)


def _checks_updates(check_updates: bool | None, params: Any) -> bool:
    if check_updates is not None:
        return bool(check_updates)
    return any(is_half(x) for x in jax.tree_util.tree_leaves(params))


def _warn_half_adam_eps(params: Any, inner: optax.GradientTransformation) -> None:
    """Warns when float16 params meet an optimizer that makes a non-finite update from a zero
    float16 gradient (optax's Adam family: its eps=1e-8 is zero in float16)."""
    if not any(
        is_inexact(x) and jnp.dtype(x.dtype) == jnp.float16
        for x in jax.tree_util.tree_leaves(params)
    ):
        return
    probe = {"p": jnp.ones([1], jnp.float16)}
    try:  # one float16 element with a zero gradient: what does the optimizer make of it?
        update, _ = inner.update({"p": jnp.zeros([1], jnp.float16)}, inner.init(probe), probe)
        bad = not bool(jnp.all(jnp.isfinite(update["p"])))
    except Exception:  # noqa: BLE001 - needs the params' structure, or traced: look at the state
        is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)
        state = jax.eval_shape(inner.init, params)
        adam = [s for s in jax.tree_util.tree_leaves(state, is_leaf=is_adam) if is_adam(s)]
        bad = any(
            jnp.dtype(x.dtype) == jnp.float16 for s in adam for x in jax.tree_util.tree_leaves(s.nu)
        )
    if bad:
        warnings.warn(
            "mpjax.loss_scale: float16 params, and the optimizer makes a non-finite update from "
            "a zero float16 gradient (Adam's moments are float16 too, where optax's default "
            "eps=1e-8 rounds to zero). loss_scale skips such steps (check_updates), but to "
            "train, keep float32 params (O2: Policy.from_level('O2', 'float16')), use "
            "bfloat16, or pass a larger eps (optax.adam(1e-3, eps=1e-4)).",
            HalfAdamWarning,
            stacklevel=4,  # the caller of loss_scale's init
        )


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    """`new` if the scalar `pred` else `old`; PRNG keys through their key data.

    One ``select_n`` with the scalar predicate, not ``jnp.where`` (a jitted broadcast and
    select): the same bits, and a third of the equations to trace for a model's every param
    and optimizer-state leaf."""
    if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
        data = _select(pred, jax.random.key_data(new), jax.random.key_data(old))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(new))
    new, old = jnp.asarray(new), jnp.asarray(old, new.dtype)
    if new.shape != old.shape:
        new, old = jnp.broadcast_arrays(new, old)
    return jax.lax.select_n(pred, old, new)


def find_states(opt_state: Any) -> list[LossScaleState]:
    def is_state(x: Any) -> bool:
        return isinstance(x, LossScaleState)

    found = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_state) if is_state(x)]
    # A wrap form's inner state may hold another (loss_scale(chain(loss_scale(), ...))), which
    # would unscale twice: count it too.
    return found + [inner for x in found for inner in find_states(x.inner_state)]


class InexactSkipWarning(UserWarning):
    """A stateful transformation follows ``mpjax.loss_scale()`` in a chain, so a skipped step
    still moves its state (and may move the params). Wrap it instead:
    ``mpjax.loss_scale(optax.chain(...))``.

    Example:
      >>> import warnings, jax.numpy as jnp, optax, mpjax
      >>> state = optax.chain(mpjax.loss_scale(), optax.adam(1e-3)).init({"w": jnp.ones(2)})
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = mpjax.get_loss_scale(state)
      >>> caught[0].category.__name__
      'InexactSkipWarning'
    """


class HalfAdamWarning(UserWarning):
    """float16 params meet an Adam-family optimizer whose moments are float16 too, where
    optax's default ``eps=1e-8`` rounds to zero: a zero second moment then makes an infinite
    or NaN update from finite gradients. The wrap form of :func:`loss_scale` skips those
    steps; to train, keep float32 params (O2), use bfloat16, or pass a larger eps.

    Example:
      >>> import warnings, jax.numpy as jnp, optax, mpjax
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = mpjax.loss_scale(optax.adam(1e-3)).init({"w": jnp.ones(2, jnp.float16)})
      >>> caught[0].category.__name__
      'HalfAdamWarning'
    """


def _chain_neighbours(opt_state: Any) -> tuple[list[str], list[str]]:
    """The stateful transformations that follow a chain-form loss_scale() in a chain, and
    those that come before it: the type names of the states after (before) it (optax.chain's
    state is a tuple in chain order, named_chain's a dict) that hold any leaf, such as adam's
    moments, momentum's trace or a schedule's count."""
    found: list[str] = []
    before: list[str] = []

    def children(x: Any) -> list[Any]:
        if isinstance(x, Mapping):
            return list(x.values())
        return jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)[0]

    def walk(x: Any) -> None:
        if isinstance(x, LossScaleState):
            return
        kids = children(x)
        if type(x) in (tuple, list) or isinstance(x, Mapping):
            for i, kid in enumerate(kids):
                if isinstance(kid, LossScaleState) and isinstance(
                    kid.inner_state, optax.EmptyState
                ):
                    after = [k for k in kids[i + 1 :] if jax.tree_util.tree_leaves(k)]
                    found.extend(_state_name(k) for k in after)
                    ahead = [k for k in kids[:i] if jax.tree_util.tree_leaves(k)]
                    before.extend(_state_name(k) for k in ahead)
        for kid in kids:
            if kid is not x:  # a leaf is its own only child
                walk(kid)

    walk(opt_state)
    return found, before


# Frames of these packages are not the user's line a warning should point at.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (optax, jax) if m.__file__
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` in this function's caller that names the first
    frame outside mpjax, optax and JAX: the user's line."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _state_name(state: Any) -> str:
    named = [
        type(s).__name__
        for s in jax.tree_util.tree_leaves(state, is_leaf=lambda y: hasattr(y, "_fields"))
        if hasattr(s, "_fields") and jax.tree_util.tree_leaves(s)
    ]
    return "/".join(dict.fromkeys(named)) or type(state).__name__


_CHECKED: set[Any] = set()  # state structures already looked at (each warns at most once)


def _warn_if_inexact(opt_state: Any) -> None:
    key = jax.tree_util.tree_structure(opt_state)
    if key in _CHECKED:
        return
    _CHECKED.add(key)
    followers, leaders = _chain_neighbours(opt_state)
    if leaders:
        warnings.warn(
            f"optax.chain(..., mpjax.loss_scale()) comes after stateful transformations "
            f"({', '.join(leaders)}): they see the scaled gradients before loss_scale() checks "
            "them, so one non-finite step puts inf or NaN into their state (a momentum trace, "
            "Adam's moments) and every later step is skipped while the scale halves. Put "
            "mpjax.loss_scale() first in the chain, or wrap the optimizer: "
            "mpjax.loss_scale(optax.chain(...)).",
            InexactSkipWarning,
            stacklevel=user_stacklevel(),
        )
    if not followers:
        return
    warnings.warn(
        f"optax.chain(mpjax.loss_scale(), ...) is followed by stateful transformations "
        f"({', '.join(followers)}): on a skipped (non-finite) step they still advance their "
        "state with zero gradients, so momentum or Adam moments move the params and schedules "
        "count the step. Wrap them instead, mpjax.loss_scale(optax.chain(...)) or "
        "mpjax.loss_scale(optax.adamw(...)): a skipped step then changes no param and no "
        "optimizer state.",
        InexactSkipWarning,
        stacklevel=user_stacklevel(),
    )


def _the_state(opt_state: Any, caller: str) -> LossScaleState:
    found = find_states(opt_state)
    if not found:
        raise ValueError(
            f"{caller}: opt_state holds no mpjax.loss_scale() state. Build the optimizer with "
            "optax.chain(mpjax.loss_scale(), ...) or mpjax.loss_scale(inner) and pass the state "
            "its init returned."
        )
    if len(found) > 1:
        raise ValueError(
            f"{caller}: opt_state holds {len(found)} mpjax.loss_scale() states; use one "
            "loss_scale() per optimizer (or pass the sub-state you mean)."
        )
    _warn_if_inexact(opt_state)
    return found[0]


def get_loss_scale(opt_state: Any) -> ls_lib.LossScale:
    """Returns the current loss scale from anywhere in an optimizer state.

    Finds the one :class:`LossScaleState` in a nested state (``optax.chain``, the wrap form,
    ``optax.inject_hyperparams``, ``optax.MultiSteps``, ...). Works inside ``jax.jit``.

    Raises:
      ValueError: if the state holds no loss-scale state, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax, mpjax
      >>> state = optax.chain(mpjax.loss_scale(), optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> float(mpjax.get_loss_scale(state).loss_scale)
      32768.0
    """
    return _the_state(opt_state, "get_loss_scale").loss_scale


def _describe_value(x: Any) -> str:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {np.dtype(dtype).name}{list(shape)} array"
    return f"a {type(x).__name__}"


def _optimizer_state(state: Any) -> Any:
    """The optimizer state in `state`: an optimizer state, a TrainState or an
    ``nnx.Optimizer`` (its ``opt_state``)."""
    return state.opt_state if _is_nnx(state, "Optimizer") else state


def loss_scale_of(state: Any) -> ls_lib.LossScale:
    """The loss scale in `state`: an optimizer state, a TrainState or an ``nnx.Optimizer``."""
    return get_loss_scale(_optimizer_state(state))


def _is_nnx(x: Any, kind: str) -> bool:
    """Whether `x` is a Flax NNX `kind` (``Module``, ``Optimizer``), without importing Flax
    where it is not loaded."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, getattr(nnx, kind, ()))


def scaled_value_and_grad(
    fun: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """Returns ``g(state, params, *args) -> (value, grads)``: the loss scaled, differentiated.

    One contract for optax, Flax linen and NNX. `state` holds the loss scale: an optimizer
    state with a :func:`loss_scale` in it (found as :func:`get_loss_scale` finds it), a
    linen :class:`mpjax.flax.TrainState`, or an ``nnx.Optimizer``. `params` is what is
    differentiated: a pytree of arrays, or an NNX module (its ``nnx.Param`` s, through
    ``nnx.value_and_grad``). `value` is ``fun(params, *args)`` as computed (the loss
    unscaled); `grads` are the gradients of the *scaled* loss, which is what ``tx.update`` (or
    ``optimizer.update``) of a :func:`loss_scale` transformation takes: it unscales them,
    checks them, skips and adjusts the scale. Nothing to scale or unscale by hand, so none of
    the three ways to get it wrong (forgetting to scale, unscaling before the update, scaling
    twice) is left. :func:`mpjax.fp8.scaled_value_and_grad` takes the same arguments and
    returns its FP8 state's next scales beside them.

    Args:
      fun: the loss, ``fun(params, *args, **kwargs)`` returning a float scalar (or
        ``(loss, aux)`` with `has_aux`).
      has_aux: whether `fun` returns ``(loss, aux)``; `value` is then ``(loss, aux)``.

    Returns:
      A function of ``(state, params, *args, **kwargs)``.

    Raises:
      ValueError: if `state` holds no loss-scale state (or more than one).

    Example:
      >>> import jax, jax.numpy as jnp, optax, mpjax
      >>> tx = mpjax.loss_scale(optax.adam(0.1))          # the wrap form: exact skips
      >>> params = {"w": jnp.ones(3)}
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda p, x: jnp.sum((p["w"] * x) ** 2)
      >>> loss, grads = mpjax.scaled_value_and_grad(loss_fn)(opt_state, params, jnp.ones(3))
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> new = optax.apply_updates(params, updates)
      >>> float(loss), grads["w"][0].item(), round(new["w"][0].item(), 4)  # grads of 2**15 * loss
      (3.0, 65536.0, 0.9)
    """

    if not callable(fun):
        raise TypeError(
            f"scaled_value_and_grad takes the loss function, got {type(fun).__name__}; the "
            "state comes in the call it returns: "
            "mpjax.scaled_value_and_grad(loss_fn)(state, params, *batch)."
        )

    def wrapped(state: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if not find_states(_optimizer_state(state)):
            raise ValueError(
                f"mpjax.scaled_value_and_grad(loss_fn)(state, params, *batch): the first "
                f"argument, a {type(state).__name__}, holds no mpjax.loss_scale() state. It is "
                "the optimizer state (or TrainState, nnx.Optimizer) of a tx built with "
                "mpjax.loss_scale; the params come second."
            )
        scale = loss_scale_of(state)

        def scaled(p: Any, *a: Any, **k: Any) -> Any:
            out = fun(p, *a, **k)
            if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    "scaled_value_and_grad(..., has_aux=True) needs the loss function to "
                    f"return a pair (loss, aux); it returned {_describe_value(out)}. Return "
                    "(loss, aux), or drop has_aux=True."
                )
            return scale.scale(out[0] if has_aux else out), out

        if _is_nnx(params, "Module"):
            from flax import nnx

            grad_fn = nnx.value_and_grad(scaled, has_aux=True)
            (_, out), grads = grad_fn(params, *args, **kwargs)
        else:
            bound = lambda p: scaled(p, *args, **kwargs)
            (_, out), grads = jax.value_and_grad(bound, has_aux=True)(params)
        return out, grads

    return wrapped


value_and_grad = renamed(
    "mpjax.value_and_grad", "mpjax.scaled_value_and_grad", scaled_value_and_grad
)


def loss_scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Returns scalars for logging: scale, skipped steps, consecutive skips, last step finite.

    Jittable. Keys: ``loss_scale`` (float32), ``skipped_steps`` (int32),
    ``consecutive_skips`` (int32), ``last_step_finite`` (bool).

    Raises:
      ValueError: if the state holds no loss-scale state, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax, mpjax
      >>> state = optax.chain(mpjax.loss_scale(), optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> sorted(mpjax.loss_scale_metrics(state))
      ['consecutive_skips', 'last_step_finite', 'loss_scale', 'skipped_steps']
    """
    state = _the_state(opt_state, "loss_scale_metrics")
    found: dict[str, Any] = {
        "loss_scale": state.loss_scale.loss_scale,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
        "last_step_finite": state.last_finite,
    }
    if state.nonfinite is not None:
        found["nonfinite_leaves"] = state.nonfinite.mask
    # Arrays, also from an nnx.Optimizer's state, which wraps each in a Variable.
    metrics = {k: jnp.asarray(arrays_of(v)) for k, v in found.items()}
    metrics["loss_scale"] = metrics["loss_scale"].astype(jnp.float32)
    return metrics


def nonfinite_leaves(opt_state: Any) -> list[str]:
    """Names the gradient leaves that were non-finite on the last step (host-side).

    Needs ``loss_scale(..., track_nonfinite=True)``; the paths are those of
    ``jax.tree_util.keystr`` over the params, e.g. ``"['Dense_1']['kernel']"``. Inside jit,
    use ``loss_scale_metrics(opt_state)["nonfinite_leaves"]`` (a boolean mask) instead.

    Raises:
      ValueError: if the state has no loss-scale state, or tracking is off.

    Example:
      >>> import jax.numpy as jnp, optax, mpjax
      >>> tx = mpjax.loss_scale(optax.sgd(0.1), track_nonfinite=True)
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
      >>> _, state = tx.update({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])},
      ...                      tx.init(params), params)
      >>> mpjax.nonfinite_leaves(state)
      ["['b']"]
    """
    state = _the_state(opt_state, "nonfinite_leaves")
    if state.nonfinite is None:
        raise ValueError(
            "nonfinite_leaves: this optimizer does not track them; build it with "
            "mpjax.loss_scale(..., track_nonfinite=True)."
        )
    return state.nonfinite.names()
