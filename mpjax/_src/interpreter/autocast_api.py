"""The public `autocast`: it traces a function once per argument structure (a cache), then
evaluates its jaxpr under the policy (autocast.py's evaluation and rules)."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from mpjax._src import hardware, levels
from mpjax._src import jax_compat as jc
from mpjax._src.dtypes import is_float_dtype
from mpjax._src.interpreter import kernels
from mpjax._src.interpreter.autocast import Context, eval_jaxpr, trace_body
from mpjax._src.interpreter.values import cast, dynamic_leaves, fill_dynamic
from mpjax._src.policy import Policy


def trace_call(
    ctx: Context, fn: Callable[..., Any], args: Any, kwargs: Any
) -> tuple[Any, Any, list[Any]]:
    """`fn(*args, **kwargs)` traced at its array leaves for evaluation under `ctx`: (closed
    jaxpr, output tree, the array leaves to evaluate it on). Non-array leaves are baked in, as
    jax.jit's static arguments; fused kernels are traced in the policy's half (kernels.py)."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = dynamic_leaves(leaves)
    return _trace_leaves(ctx, fn, leaves, treedef, dynamic) + ([leaves[i] for i in dynamic],)


def flat_call(
    fn: Callable[..., Any], leaves: list[Any], treedef: Any, dynamic: list[int]
) -> Callable[..., Any]:
    """`fn` as a function of the dynamic leaves alone; the others are baked in."""

    def flat_fn(*arrays: Any) -> Any:
        a, k = jax.tree_util.tree_unflatten(treedef, fill_dynamic(leaves, dynamic, arrays))
        return fn(*a, **k)

    return flat_fn


def kernels_in_half(
    policy: Policy, rules: Mapping[str, Policy] | None = None
) -> contextlib.AbstractContextManager[None]:
    """Fused kernels called inside run in `policy`'s half, as under autocast (kernels.py):
    for a Flax model's init, which runs its forward pass outside autocast."""
    if not levels.of(policy).interprets:
        return contextlib.nullcontext()
    return kernels.in_half(Context(policy, dict(rules or {})))


def _trace_leaves(
    ctx: Context, fn: Callable[..., Any], leaves: list[Any], treedef: Any, dynamic: list[int]
) -> Any:
    flat_fn = flat_call(fn, leaves, treedef, dynamic)
    with kernels.in_half(ctx):
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(
            *[leaves[i] for i in dynamic]
        )
    return closed, jax.tree_util.tree_structure(out_shape)


def evaluate(ctx: Context, closed: Any, arrays: list[Any], cast_outputs: Any = True) -> list[Any]:
    """Evaluates a traced function under `ctx`'s policy; floating outputs in its output dtype
    (`cast_outputs` True), as computed (False), or, with one bool per output, those marked in
    the dtype the function itself returns (its float32 program's)."""
    if SHADOW_CACHE.get():
        ctx = ctx.replace(shadow=True)
    outs, _, _ = eval_jaxpr(ctx, closed.jaxpr, list(closed.consts), list(arrays), ctx.policy)
    if isinstance(cast_outputs, (list, tuple)):
        return [
            cast(x, a.dtype, keep_constant=ctx.shadow)
            if keep and is_float_dtype(x.dtype) and is_float_dtype(a.dtype)
            else x
            for x, a, keep in zip(outs, closed.out_avals, cast_outputs, strict=True)
        ]
    if cast_outputs:
        out_dtype = ctx.policy.output_dtype
        outs = [
            cast(x, out_dtype, keep_constant=ctx.shadow) if is_float_dtype(x.dtype) else x
            for x in outs
        ]
    return outs


def autocast(
    fn: Callable[..., Any],
    policy: Policy,
    *,
    rules: Mapping[str, Policy] | None = None,
    cast_outputs: bool | Callable[[Any], Sequence[bool]] = True,
    strict: bool = False,
) -> Callable[..., Any]:
    """Returns `fn` run under `policy`, op by op.

    `fn` is traced to a jaxpr at its input dtypes and evaluated again with casts: lower-list
    ops (``policy.lower_ops``: dot_general, conv) get half operands, f32-list ops
    (``policy.f32_ops``: exp, log, reductions, ...) get float32 operands, and other ops follow
    their inputs at O1 (the widest float wins) or run in half at O2/O3. Integer, boolean and
    PRNG-key values are never cast. Floating outputs are cast to ``policy.output_dtype``.

    The result is differentiable and jittable, and works inside and around jit, vmap and
    scan. It recurses into jit, custom_jvp/custom_vjp (keeping their rules), scan, while,
    cond, remat and shard_map; a primitive it does not know, or leaves alone by design
    (linear algebra, collectives), runs in its traced dtypes under a ``mpjax_untouched`` name
    scope, and the audit lists it with the reason. A sub-program (a body) left that way warns
    unless autocast leaves it by design; ``strict=True`` raises instead. At O0 `fn` is
    returned as-is.

    Memory: float32 values computed from half ones (a norm's statistics, a loss) are
    recomputed for the backward pass from those half values (a ``jax.checkpoint`` region per
    island) instead of being kept in float32; a float32 softmax whose result is cast to half
    is differentiated from that half result, as a half softmax is; and a remat of `fn`'s own
    keeps its policy and, at O2, half operands and results. The Memory guide has the
    measurements.

    Args:
      fn: any JAX function of arrays (non-array arguments are treated as static).
      policy: the precision policy, e.g. ``Policy.from_level("O1")``.
      rules: advanced: policies for ``jax.named_scope("mpjax:<key>")`` regions, by key (the
        Flax wrappers' per-module rules use this).
      cast_outputs: cast floating outputs to ``policy.output_dtype`` (default True). Advanced:
        a function of the output tree structure giving one bool per output leaf: those marked
        come back in the dtype `fn` itself returns, the rest as computed (the Flax wrappers
        return mutable collections this way).
      strict: raise a ValueError, naming the primitive and the reason, where a sub-program
        (a loop, a shard_map or custom-rule body, a higher-order primitive) would run in its
        traced dtypes instead of under the policy. Default False: it runs as traced.

    Returns:
      A function with `fn`'s signature.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> def mlp(w, x):
      ...     return jax.nn.log_softmax(jnp.tanh(x @ w))
      >>> policy = mpjax.Policy.from_level("O1", "bfloat16")
      >>> f = mpjax.autocast(mlp, policy)
      >>> f(jnp.ones((3, 4)), jnp.ones((2, 3))).dtype   # output_dtype at O1
      dtype('float32')
      >>> "bf16" in str(jax.make_jaxpr(f)(jnp.ones((3, 4)), jnp.ones((2, 3))))
      True
    """
    if type(policy).__name__ == "FP8Policy":
        raise TypeError(
            "autocast takes an mpjax.Policy; an FP8 policy runs through mpjax.fp8: "
            "mpjax.fp8.init(loss_fn, policy, *args) for its state, then "
            "mpjax.fp8.scaled_value_and_grad(loss_fn, policy) to train or "
            "mpjax.fp8.apply(fn, policy) to evaluate (or mpjax.autocast(fn, policy.base) for its "
            "half policy alone)."
        )
    if not isinstance(policy, Policy):
        raise TypeError(
            f"autocast needs an mpjax.Policy, got {type(policy).__name__}; e.g. "
            "mpjax.Policy.from_level('O1')."
        )
    if not callable(fn):
        raise TypeError(f"autocast needs a function, got {type(fn).__name__}.")
    module_kind = flax_module_kind(fn)
    if module_kind is not None:
        raise TypeError(
            f"autocast takes a function, got the Flax {module_kind} module "
            f"{type(fn).__name__}; wrap modules with mpjax.flax.wrap(module, policy), which "
            "also stores params in the policy's dtype and applies per-module rules (or "
            "autocast its apply function: mpjax.autocast(module.apply, policy))."
        )
    if not levels.of(policy).interprets and not rules:
        return fn
    hardware.warn_if_slow(policy)
    ctx = Context(policy, dict(rules or {}), strict=strict)

    cache: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = dynamic_leaves(leaves)
        arrays = [leaves[i] for i in dynamic]
        key = _signature(treedef, leaves, dynamic)
        entry = cache.get(key) if key is not None else None
        if entry is None:
            with _gc_paused():
                entry = _build(ctx, fn, leaves, treedef, dynamic, cast_outputs)
            if key is not None and entry.cacheable:
                cache[key] = entry
                if len(cache) > _CACHE_SIZE:
                    cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return entry(arrays)

    return wrapped


_CACHE_SIZE = 64

# The cache autocast's traces go to ("" outside for_shadow; see for_shadow), read where a
# call enters autocast (evaluate, the trace cache's key) and passed on in its Context.
SHADOW_CACHE: contextvars.ContextVar[str] = contextvars.ContextVar("mpjax_shadow", default="")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while autocast traces and rewrites a program.

    A trace makes many long-lived objects (two jaxprs' equations, variables and tracers), and
    each full collection the allocations trigger walks all of them (docs/guides/internals.md
    has the share of a first trace this was). What a trace drops can wait until it ends: the
    collector runs again as usual afterwards (and stays off if it was off).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def for_shadow(cache: str) -> Iterator[None]:
    """Autocast traces made inside are for a float32 shadow (mpjax.compare's): they are cached
    apart, under `cache` (a call traced before, without the Flax module paths and float32
    regions the shadow's trace adds to the name stacks, is not reused); a constant cast down
    stays a convert of its float32 value instead of folding into a half constant, so the
    shadow keeps the float32 value; and an inlined call's equations keep their own source
    lines, so the shadow's rows name them."""
    if not cache:
        raise ValueError("for_shadow needs a non-empty cache name")
    token = SHADOW_CACHE.set(cache)
    try:
        yield
    finally:
        SHADOW_CACHE.reset(token)


def flax_module_kind(fn: Any) -> str | None:
    """'linen' or 'NNX' when `fn` is a Flax module (without importing Flax otherwise)."""
    for cls in type(fn).__mro__:
        if cls.__name__ == "Module" and cls.__module__.startswith("flax.linen"):
            return "linen"
        if cls.__name__ == "Module" and cls.__module__.startswith("flax.nnx"):
            return "NNX"
    return None


def _signature(treedef: Any, leaves: list[Any], dynamic: list[int]) -> Any:
    """What a trace depends on, as jax.jit keys its cache: the tree, the static leaves, and
    each array's shape, dtype and weak type. None when a static leaf is unhashable."""
    dynamic_at = set(dynamic)
    try:
        static = tuple((i, x) for i, x in enumerate(leaves) if i not in dynamic_at)
        hash(static)
        avals = tuple(jc.aval_of(leaves[i]) for i in dynamic)
        hash(avals)
    except TypeError:
        return None
    return (treedef, static, avals, str(jc.current_name_stack()), SHADOW_CACHE.get())


class _Entry:
    """One traced signature: the autocast jaxpr, run jitted when called eagerly."""

    def __init__(self, closed: Any, out_tree: Any, direct: Callable[..., Any] | None):
        self.out_tree = out_tree
        self.cacheable = direct is None
        self.direct = direct
        if closed is not None:
            run = jc.jaxpr_as_fun(closed)
            self.run = run
            self.jitted = jax.jit(run)

    def __call__(self, arrays: list[Any]) -> Any:
        if self.direct is not None:
            outs = self.direct(arrays)
        elif any(isinstance(x, jax.core.Tracer) for x in arrays):
            outs = self.run(*arrays)
        else:
            outs = self.jitted(*arrays)
        return jax.tree_util.tree_unflatten(self.out_tree, list(outs))


def _build(
    ctx: Context,
    fn: Callable[..., Any],
    leaves: list[Any],
    treedef: Any,
    dynamic: list[int],
    cast_outputs: Any,
) -> _Entry:
    closed, out_tree = _trace_leaves(ctx, fn, leaves, treedef, dynamic)
    if callable(cast_outputs):
        cast_outputs = list(cast_outputs(out_tree))

    def run_flat(*arrays: Any) -> list[Any]:
        return evaluate(ctx, closed, list(arrays), cast_outputs)

    if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
        # `fn` closes over a tracer of an enclosing transformation: evaluate now, never cache.
        avals = [v.aval for v in closed.jaxpr.invars]
        return _Entry(
            None, out_tree, lambda arrays: jc.jaxpr_as_fun(trace_body(run_flat, avals))(*arrays)
        )
    ctx.memo.clear()
    casted = trace_body(run_flat, [v.aval for v in closed.jaxpr.invars])
    ctx.memo.clear()
    return _Entry(casted, out_tree, None)
