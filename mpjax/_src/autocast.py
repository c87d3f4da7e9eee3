"""Op-level autocast: trace a function to a jaxpr and evaluate it again, casting per op.

Lower-list ops (dot_general, conv) get half operands, f32-list ops (exp, log, reductions) get
float32 operands, and the rest follow their inputs at O1 (widest float wins, as torch's
promote list) or run in half at O2/O3. Regions marked with :func:`full_precision` or
:func:`half_precision` (``jax.named_scope`` markers, so they survive jit, grad and vmap)
override the policy, as do per-module rules of the Flax wrappers.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as jax_core
from jax._src import source_info_util
from jax._src.lax import lax as lax_internal

from mpjax._src import hardware, ops
from mpjax._src.policy import Policy

_MARKER = re.compile(r"mpjax:([A-Za-z0-9_]+)")
F32_REGION, HALF_REGION = "f32", "half"
UNTOUCHED_SCOPE = "mpjax_untouched"

# Calls inlined into the surrounding evaluation.
INLINE_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
}
# Higher-order primitives rebuilt with autocast sub-jaxprs whose boundary dtypes are unchanged,
# so custom differentiation rules and loop-carry types stay valid.
_SUBJAXPR_PARAMS = {
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr",),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
    "remat2": ("jaxpr",),
    "checkpoint": ("jaxpr",),
    "scan": ("jaxpr",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "cond": ("branches",),
    "shard_map": ("jaxpr",),
}
# Ops that take operands of unrelated dtypes and pass them through.
_PASS_OPS = frozenset(
    {"device_put", "optimization_barrier", "sharding_constraint", "stop_gradient", "pvary",
     "reshard", "mesh_cast", "name"}
)  # fmt: skip
# Ops that only move data: they keep their input's dtype and the first computing consumer
# casts. Besides saving converts, this keeps backward reductions in float32: the transpose of
# broadcasting a float32 bias is a float32 sum of the half cotangent, not a half sum.
SHAPE_OPS = frozenset(
    {"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "rev", "slice",
     "dynamic_slice", "gather", "copy", "copy_p"}
)  # fmt: skip
# Elementwise ops that broadcast size-1 dimensions implicitly.
_ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "select_n", "clamp",
     "nextafter"}
)  # fmt: skip
# Ops whose meaning depends on the bit width: always run in their traced dtype.
_TRACED_DTYPE_OPS = frozenset({"bitcast_convert_type", "reduce_precision", "nextafter"})


@contextlib.contextmanager
def _scope(marker: str) -> Iterator[None]:
    with jax.named_scope(f"mpjax:{marker}"):
        yield


def full_precision() -> contextlib.AbstractContextManager[None]:
    """Keeps a region in float32 under :func:`autocast` (torch's nested ``autocast(False)``).

    Use as a context manager or a decorator. Outside autocast it changes nothing.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> def f(x):
      ...     with mpjax.full_precision():
      ...         return jnp.exp(x @ x)
      >>> policy = mpjax.Policy.from_level("O2", "bfloat16")
      >>> mpjax.autocast(f, policy)(jnp.ones((2, 2))).dtype
      dtype('float32')
    """
    return _scope(F32_REGION)


def half_precision() -> contextlib.AbstractContextManager[None]:
    """Forces a region into the policy's half dtype under :func:`autocast` (f32 list included).

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> @mpjax.half_precision()
      ... def g(x):
      ...     return jnp.exp(x)
      >>> policy = mpjax.Policy.from_level("O2", "bfloat16").with_output_dtype("bfloat16")
      >>> mpjax.autocast(g, policy)(jnp.ones(2)).dtype
      dtype(bfloat16)
    """
    return _scope(HALF_REGION)


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _widest(dtypes: list[np.dtype]) -> np.dtype:
    best = dtypes[0]
    for d in dtypes[1:]:
        if d == best:
            continue
        if np.dtype(d).itemsize > np.dtype(best).itemsize:
            best = d
        elif np.dtype(d).itemsize == np.dtype(best).itemsize:
            best = np.dtype(np.float32)  # float16 meets bfloat16: neither holds the other
    return np.dtype(best)


def _cast(x: Any, dtype: np.dtype, weak_type: bool = False) -> Any:
    if x.dtype == dtype and not weak_type:
        return x
    return lax_internal._convert_element_type(x, np.dtype(dtype), weak_type)


class _Context:
    """What the evaluation needs: the region policies by marker, and the base policy."""

    def __init__(self, policy: Policy, rules: Mapping[str, Policy]):
        self.policy = policy
        self.by_marker = {
            F32_REGION: "f32",
            HALF_REGION: "half",
            **rules,
        }

    def mode_for(self, inherited: Any, name_stack: str) -> Any:
        markers = [m for m in _MARKER.findall(name_stack) if m in self.by_marker]
        return self.by_marker[markers[-1]] if markers else inherited


def _target_dtype(
    name: str, eqn: Any, vals: list[Any], mode: Any, base: Policy, held: list[bool]
) -> tuple[Any, bool]:
    """The dtype float operands are cast to (None: leave them) and whether the result is held
    in float32 (an f32-list result, or computed only from such results)."""
    traced = [v.aval.dtype for v in eqn.invars if _is_float(v.aval.dtype)]
    if not traced or name in _PASS_OPS:
        return None, False
    if name in SHAPE_OPS:
        return None, any(held)
    full = _widest([*traced, np.dtype(np.float32)])
    if name in _TRACED_DTYPE_OPS or name not in ops.KNOWN_OPS:
        return "traced", False  # unknown primitive: never wrong, only slower
    if mode == "f32":
        return full, True
    if mode == "half":
        return base.compute_dtype, False
    policy: Policy = mode
    if policy.level == "O0" or not policy.half:
        return full, False
    if name in policy.f32_ops:
        return full, True
    if name in policy.lower_ops:
        return policy.compute_dtype, False
    # Weak-typed operands and literals (Python scalars in the source) do not promote, as in jnp.
    floats = [
        (np.dtype(x.dtype), isinstance(v, jax_core.Literal) or v.aval.weak_type, h)
        for x, v, h in zip(vals, eqn.invars, held, strict=True)
        if hasattr(x, "dtype") and _is_float(x.dtype) and _is_float(v.aval.dtype)
    ]
    strong = [f for f in floats if not f[1]] or floats
    if policy.level == "O1":
        return (_widest([d for d, _, _ in strong]), False) if strong else (None, False)
    if strong and all(h for _, _, h in strong):
        # O2: what an f32-list op produced stays float32 until it meets a half value, so
        # softmax, logsumexp and the loss are float32 from end to end (torch.amp alike).
        return None, True
    return policy.compute_dtype, False


def _fix_params(params: dict[str, Any], target: Any) -> dict[str, Any]:
    """A matmul's output dtype follows its (cast) operands."""
    pref = params.get("preferred_element_type")
    if pref is not None and _is_float(pref) and target is not None:
        params = {**params, "preferred_element_type": np.dtype(target)}
    return params


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, jax_core.Literal) else env[v]


def _eval_jaxpr(
    jaxpr: Any,
    consts: list[Any],
    args: list[Any],
    ctx: _Context,
    mode: Any,
    traceback: Any = None,
) -> list:
    """Evaluates `jaxpr` under the policy. `traceback`, for an inlined call, is the call
    site's: the inner equations' own may come from a cached trace made elsewhere."""
    env: dict[Any, Any] = {}
    held: set[Any] = set()  # vars whose values are held in float32 (see _target_dtype)
    casts: dict[
        tuple[Any, np.dtype, tuple[int, ...]], Any
    ] = {}  # one convert per value and dtype, not per use

    def cast_var(v: Any, x: Any, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        if isinstance(v, jax_core.Literal) or x.dtype == dtype:
            return _cast(x, dtype)
        key = (v, np.dtype(dtype), shape)
        if key not in casts:
            if x.ndim == len(shape) and x.shape != shape and np.dtype(dtype).itemsize < 4:
                # Broadcast in float32 before casting down: the transpose is then a float32
                # sum (a bias gradient), not a half one.
                x = lax.broadcast_in_dim(x, shape, tuple(range(x.ndim)))
            casts[key] = _cast(x, dtype)
        return casts[key]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        eqn_mode = ctx.mode_for(mode, str(eqn.source_info.name_stack))
        invals = [_read(env, v) for v in eqn.invars]
        in_held = [not isinstance(v, jax_core.Literal) and v in held for v in eqn.invars]
        tb = traceback if traceback is not None else eqn.source_info.traceback
        with source_info_util.user_context(tb, name_stack=name_stack):
            with eqn.ctx.manager:
                outvals, hold = _eval_eqn(eqn, invals, ctx, eqn_mode, in_held, cast_var, tb)
        if not eqn.primitive.multiple_results:
            outvals = [outvals]
        for v, x in zip(eqn.outvars, outvals, strict=True):
            if not isinstance(v, jax_core.DropVar):
                env[v] = x
                if hold:
                    held.add(v)
    return [_read(env, v) for v in jaxpr.outvars]


def _to_traced(vals: list[Any], avals: list[Any]) -> list[Any]:
    out = []
    for x, aval in zip(vals, avals, strict=True):
        if hasattr(x, "dtype") and _is_float(x.dtype) and x.dtype != aval.dtype:
            x = _cast(x, aval.dtype, getattr(aval, "weak_type", False))
        out.append(x)
    return out


class _CannotRebuild(Exception):
    """A sub-jaxpr cannot be rebuilt with casts; the equation then runs as traced."""


def _shard_map_context(params: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """The axis environment, manual mesh and vma checking that shard_map traces its body in."""
    try:
        from jax._src import config
        from jax._src import shard_map as shard_map_internal
        from jax._src.mesh import use_abstract_mesh
    except ImportError:
        raise _CannotRebuild("shard_map internals moved") from None
    mesh, manual = params["mesh"], params.get("newly_manual_axes", frozenset())
    stack = contextlib.ExitStack()
    stack.enter_context(shard_map_internal._extend_axis_env(mesh, manual))
    stack.enter_context(use_abstract_mesh(shard_map_internal._as_manual_mesh(mesh, manual)))
    stack.enter_context(config._check_vma(params.get("check_vma", True)))
    return stack


def _trace(body: Callable[..., list[Any]], avals: list[Any], context: Any = None) -> Any:
    """Traces `body` at exactly `avals` (weak types and shard_map's varying axes included)."""
    try:
        from jax._src import api_util
        from jax._src import linear_util as lu
        from jax._src.interpreters import partial_eval as pe

        debug = api_util.debug_info("mpjax.autocast", body, tuple(avals), {})
        fun = lu.wrap_init(body, debug_info=debug)
        with context or contextlib.nullcontext():
            jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fun, list(avals))
        return jax_core.ClosedJaxpr(jaxpr, consts)
    except (ImportError, AttributeError, TypeError):  # JAX internals moved: the public way
        if context is not None:
            raise _CannotRebuild("no internal tracing API for a named-axis body") from None
        specs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
            for a in avals
        ]
        return jax.make_jaxpr(body)(*specs)


def _rebuild_closed(
    closed: Any, ctx: _Context, mode: Any, context: Any = None, traceback: Any = None
) -> Any:
    """The sub-jaxpr with autocast inside and its traced dtypes at the boundary."""

    def body(*args: Any) -> list[Any]:
        outs = _eval_jaxpr(closed.jaxpr, list(closed.consts), list(args), ctx, mode, traceback)
        return _to_traced(outs, closed.out_avals)

    return _trace(body, list(closed.in_avals), context)


def _rebuild_param(
    value: Any, ctx: _Context, mode: Any, context: Any = None, traceback: Any = None
) -> Any:
    if isinstance(value, tuple):
        return tuple(_rebuild_param(v, ctx, mode, context, traceback) for v in value)
    if isinstance(value, jax_core.ClosedJaxpr):
        return _rebuild_closed(value, ctx, mode, context, traceback)
    if isinstance(value, jax_core.Jaxpr):
        if value.constvars:
            raise _CannotRebuild("open jaxpr with constvars")
        rebuilt = _rebuild_closed(jax_core.ClosedJaxpr(value, []), ctx, mode, context, traceback)
        if rebuilt.consts:
            raise _CannotRebuild("rebuilt jaxpr captured constants")
        return rebuilt.jaxpr
    return value


def _bind(eqn: Any, invals: list[Any], params: dict[str, Any]) -> Any:
    return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))


def _bind_untouched(eqn: Any, invals: list[Any]) -> Any:
    # Marked in the HLO metadata so that the audit can show where autocast stood aside.
    with jax.named_scope(f"{UNTOUCHED_SCOPE}:{eqn.primitive.name}"):
        return _bind(eqn, _to_traced(invals, [v.aval for v in eqn.invars]), eqn.params)


def _eval_eqn(
    eqn: Any,
    invals: list[Any],
    ctx: _Context,
    mode: Any,
    in_held: list[bool],
    cast_var: Callable[[Any, Any, np.dtype, tuple[int, ...]], Any],
    traceback: Any = None,
) -> tuple[Any, bool]:
    name = eqn.primitive.name
    if name in INLINE_CALLS:
        closed = eqn.params[INLINE_CALLS[name]]
        outs = _eval_jaxpr(closed.jaxpr, list(closed.consts), invals, ctx, mode, traceback)
        return outs, False
    if name in _SUBJAXPR_PARAMS:
        try:
            params = dict(eqn.params)
            for key in _SUBJAXPR_PARAMS[name]:
                context = _shard_map_context(params) if name == "shard_map" else None
                params[key] = _rebuild_param(params[key], ctx, mode, context, traceback)
            return _bind(eqn, _to_traced(invals, [v.aval for v in eqn.invars]), params), False
        except _CannotRebuild:
            if name in ("remat2", "checkpoint"):  # lose the remat, keep the precision
                return _eval_jaxpr(eqn.params["jaxpr"], [], invals, ctx, mode, traceback), False
            return _bind_untouched(eqn, invals), False
    if any(isinstance(p, (jax_core.Jaxpr, jax_core.ClosedJaxpr)) for p in eqn.params.values()):
        return _bind_untouched(eqn, invals), False  # a higher-order primitive we do not know

    target, hold = _target_dtype(name, eqn, invals, mode, ctx.policy, in_held)
    if target is None:
        return _bind(eqn, invals, eqn.params), hold
    if isinstance(target, str):  # "traced"
        return _bind_untouched(eqn, invals), False
    if name == "convert_element_type":
        src, dst = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
        if src == dst and _is_float(dst):  # a weak-type change only: keep the current dtype
            return invals[0], in_held[0]
        return _bind(eqn, invals, eqn.params), False
    out_shape = tuple(eqn.outvars[0].aval.shape) if name in _ELEMENTWISE else None
    cast_vals = [
        cast_var(v, x, target, out_shape if out_shape is not None else tuple(x.shape))
        if hasattr(x, "dtype") and _is_float(x.dtype) and _is_float(v.aval.dtype)
        else x
        for x, v in zip(invals, eqn.invars, strict=True)
    ]
    return _bind(eqn, cast_vals, _fix_params(eqn.params, target)), hold


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def autocast(
    fn: Callable[..., Any],
    policy: Policy,
    *,
    rules: Mapping[str, Policy] | None = None,
    cast_outputs: bool = True,
) -> Callable[..., Any]:
    """Returns `fn` run under `policy`, op by op.

    `fn` is traced to a jaxpr at its input dtypes and evaluated again with casts: lower-list
    ops (``policy.lower_ops``: dot_general, conv) get half operands, f32-list ops
    (``policy.f32_ops``: exp, log, reductions, ...) get float32 operands, and other ops follow
    their inputs at O1 (the widest float wins) or run in half at O2/O3. Integer, boolean and
    PRNG-key values are never cast. Floating outputs are cast to ``policy.output_dtype``.

    The result is differentiable and jittable, and works inside and around jit, vmap and
    scan. It recurses into jit, custom_jvp/custom_vjp (keeping their rules), scan, while,
    cond and remat; a primitive it does not know runs in its traced dtypes, under a
    ``mpjax_untouched`` name scope that the audit can show. At O0 `fn` is returned as-is.

    Args:
      fn: any JAX function of arrays (non-array arguments are treated as static).
      policy: the precision policy, e.g. ``Policy.from_level("O1")``.
      rules: advanced: policies for ``jax.named_scope("mpjax:<key>")`` regions, by key (the
        Flax wrappers' per-module rules use this).
      cast_outputs: cast floating outputs to ``policy.output_dtype`` (default True).

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
    if not isinstance(policy, Policy):
        raise TypeError(
            f"autocast needs an mpjax.Policy, got {type(policy).__name__}; e.g. "
            "mpjax.Policy.from_level('O1')."
        )
    if not callable(fn):
        raise TypeError(f"autocast needs a function, got {type(fn).__name__}.")
    if policy.level == "O0" and not rules:
        return fn
    hardware.warn_if_slow(policy)
    ctx = _Context(policy, dict(rules or {}))

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if _is_dynamic(x)]

        def flat_fn(*dyn: Any) -> Any:
            full = list(leaves)
            for i, x in zip(dynamic, dyn, strict=True):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            return fn(*a, **k)

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(
            *[leaves[i] for i in dynamic]
        )
        outs = _eval_jaxpr(
            closed.jaxpr, list(closed.consts), [leaves[i] for i in dynamic], ctx, policy
        )
        if cast_outputs:
            outs = [_cast(x, policy.output_dtype) if _is_float(x.dtype) else x for x in outs]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped
