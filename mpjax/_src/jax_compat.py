"""Every use of JAX internals (``jax._src``) in mpjax, each branch naming its JAX versions.

mpjax supports JAX 0.6.0 to the newest release. Public APIs are used wherever they exist; what
follows has no public equivalent (evaluating and re-tracing jaxprs, custom-derivative rules,
shard_map's manual axes, HLO source locations).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import (
    core,  # Literal, DropVar, Jaxpr, ClosedJaxpr: same names in 0.6-0.10
    source_info_util,
)
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as lax_internal

Literal = core.Literal
DropVar = core.DropVar
Jaxpr = core.Jaxpr
ClosedJaxpr = core.ClosedJaxpr
# The types the interpreters read: an equation, a variable, an operand (a variable or a
# literal), a primitive.
JaxprEqn = core.JaxprEqn
Var = core.Var
Atom = core.Atom
Primitive = core.Primitive
AbstractValue = core.AbstractValue
ShapedArray = core.ShapedArray
# What an interpreter holds for a variable: a tracer or a concrete array (a literal's value,
# a Python or NumPy scalar, is read as one). And where an equation was written.
Value = jax.Array
Traceback = source_info_util.Traceback


def aval(v: Atom) -> core.ShapedArray:
    """The shaped abstract value of a variable or literal (JAX types ``Var.aval`` as the base
    class, which has no dtype or shape)."""
    return v.aval  # type: ignore[return-value]


def literal_array(v: Any) -> np.ndarray:
    """A Literal's value as a NumPy array of its aval's dtype.

    JAX 0.6-0.8 store a Python scalar; 0.9+ a ``TypedFloat``/``TypedInt`` (which has no shape).
    """
    return np.asarray(v.val, dtype=v.aval.dtype)


def aval_of(x: Any) -> Any:
    """The abstract value of an array or tracer (``jax.typeof`` from 0.7, else ``get_aval``)."""
    typeof = getattr(jax, "typeof", None) or getattr(core, "get_aval")  # noqa: B009
    return typeof(x)


def convert(x: Any, dtype: Any, weak_type: bool = False) -> Any:
    """``convert_element_type`` that can also set the weak type (private in every version)."""
    return lax_internal._convert_element_type(x, np.dtype(dtype), weak_type)


def typed_sharding(aval: Any) -> Any:
    """The sharding `aval` carries in its type, where some axis is sharded (Explicit mesh
    axes), else None. An op that stands for a value of this type must be given it: a
    broadcast without it is typed replicated, and its transpose all-gathers the cotangent."""
    sharding = getattr(aval, "sharding", None)  # in the aval from JAX 0.5; None before
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(axis is not None for axis in spec):
        return None
    return sharding


def permuted_sharding(aval: Any, axes: Any) -> Any:
    """The sharding of `aval`'s type with its axes taken in the order `axes`, for an op that
    makes `aval`'s value transposed by `axes`; None where the type carries no mesh axes (Auto
    axes, or JAX before 0.5), so the op infers its own."""
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or spec is None or mesh is None or not getattr(mesh, "axis_names", ()):
        return None
    if not any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ())):
        return None
    padded = tuple(spec) + (None,) * (len(aval.shape) - len(spec))
    new_spec = type(spec)(*(padded[int(a)] for a in axes))
    if hasattr(sharding, "update"):
        return sharding.update(spec=new_spec)
    return type(sharding)(mesh, new_spec)  # JAX 0.6: no NamedSharding.update


def bind(primitive: Any, args: list[Any], params: dict[str, Any], wrap_rule: Any = None) -> Any:
    """Binds `primitive` with the parameters an equation recorded.

    `wrap_rule`, if given, maps each custom-derivative rule (a ``WrappedFun``) to a new one, so
    that the rules run under autocast too.
    """
    bind_params = primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # JAX 0.6-0.7: (subfuns, params)
        subfuns, bind_params = bind_params
        subfuns = list(subfuns)
        if wrap_rule is not None:
            subfuns = subfuns[:1] + [wrap_rule(f) for f in subfuns[1:]]
            if "bwd" in bind_params:  # custom_vjp_call_jaxpr (0.6): the rules are params
                bind_params = dict(bind_params)
                bind_params["bwd"] = wrap_rule(bind_params["bwd"])
                thunk = bind_params["fwd_jaxpr_thunk"]
                bind_params["fwd_jaxpr_thunk"] = _wrap_fwd_thunk(thunk, wrap_rule)
        return primitive.bind(*subfuns, *args, **bind_params)
    if wrap_rule is not None and "subfuns" in bind_params:  # JAX 0.8+: rules are subfuns
        fun, *rules = bind_params["subfuns"]
        bind_params = {**bind_params, "subfuns": (fun, *[wrap_rule(f) for f in rules])}
    return primitive.bind(*args, **bind_params)


def _wrap_fwd_thunk(thunk: Callable[..., Any], wrap_rule: Any) -> Callable[..., Any]:
    """JAX 0.6-0.7: custom_vjp's forward rule is a thunk giving (jaxpr, consts)."""

    def new_thunk(*zeros: Any) -> Any:
        jaxpr, consts = thunk(*zeros)

        def fwd(*args: Any) -> Any:
            return core.eval_jaxpr(jaxpr, consts, *args)

        rule = wrap_rule(wrap_fun(None, fwd))
        closed = trace(rule.call_wrapped, [v.aval for v in jaxpr.invars])
        return closed.jaxpr, closed.consts

    return new_thunk


def jaxpr_as_fun(closed: Any) -> Callable[..., Any]:
    """A function evaluating a closed jaxpr (public as ``jax.extend.core.jaxpr_as_fun``)."""
    return core.jaxpr_as_fun(closed)


def wrap_fun(f: Any, new: Callable[..., Any]) -> Any:
    """A ``WrappedFun`` calling `new`, keeping `f`'s debug info (0.6 needs one)."""
    from jax._src import api_util

    debug = getattr(f, "debug_info", None) or api_util.debug_info("mpjax", new, (), {})
    return lu.wrap_init(new, debug_info=debug)


def trace(body: Callable[..., Any], avals: list[Any], context: Any = None) -> Any:
    """Traces `body` at exactly `avals` (weak types and shard_map's varying axes included).

    Values `body` closes over that are tracers of an enclosing trace become the jaxpr's consts.
    """
    from jax._src import api_util

    debug = api_util.debug_info("mpjax.autocast", body, tuple(avals), {})
    fun = lu.wrap_init(body, debug_info=debug)
    with context or contextlib.nullcontext():
        out = pe.trace_to_jaxpr_dynamic(fun, list(avals))
    jaxpr, consts = out[0], out[2]  # (jaxpr, out_avals, consts[, attrs]) in 0.6-0.10
    return core.ClosedJaxpr(jaxpr, consts)


def current_name_stack() -> Any:
    return source_info_util.current_name_stack()


def user_context(traceback: Any, name_stack: Any) -> contextlib.AbstractContextManager[Any]:
    return source_info_util.user_context(traceback, name_stack=name_stack)


def common_name_stack(stacks: list[Any]) -> Any:
    """The longest name stack that every one of `stacks` starts with."""
    parts = [tuple(s.stack) for s in stacks]
    n = 0
    if parts:
        shortest = min(len(p) for p in parts)
        while n < shortest and all(p[n] == parts[0][n] for p in parts):
            n += 1
    return source_info_util.NameStack(parts[0][:n] if parts else ())


def relative_name_stack(stack: Any, prefix: Any) -> Any:
    """`stack` after `prefix`; empty when `stack` does not start with it."""
    n = len(prefix.stack)
    inside = tuple(stack.stack[:n]) == tuple(prefix.stack)
    return source_info_util.NameStack(tuple(stack.stack[n:]) if inside else ())


class CannotRebuild(Exception):
    """A sub-jaxpr cannot be rebuilt in this JAX version; the equation then runs as traced."""


class shard_map_context:  # noqa: N801 - used as a context manager, as contextlib's are
    """The axis environment, manual mesh and vma checking that shard_map traces its body in.

    Reusable: each ``with`` enters it afresh, since a body is traced more than once (autocast's
    trace, then the float32 islands' retrace). A one-shot ``contextlib.contextmanager`` fails
    on the second entry.

    JAX 0.6.1+ keeps shard_map in ``jax._src.shard_map``; 0.6.0 in ``jax.experimental``, with
    the axes left automatic (``auto``) and ``check_rep`` in its params. From 0.6.1 the equation
    names the axes it makes manual ``manual_axes`` (to 0.10.1) or ``newly_manual_axes`` (from
    0.10.2); either way they exclude the axes an enclosing shard_map already made manual
    (``mesh.manual_axes``).
    """

    def __init__(self, params: dict[str, Any]):
        from jax._src import config
        from jax._src.mesh import use_abstract_mesh

        mesh = params["mesh"]
        self._stacks: list[contextlib.ExitStack] = []
        if "auto" in params and "check_rep" in params:  # JAX 0.6.0: jax.experimental.shard_map
            old: Any = importlib.import_module("jax.experimental.shard_map")
            auto, check = params["auto"], getattr(config, "_check_rep")  # noqa: B009 - 0.6.0 only
            self._enter = [
                lambda: old._extend_axis_env(mesh, auto),
                lambda: use_abstract_mesh(old._as_manual_mesh(mesh, auto)),
                lambda: check(params["check_rep"]),
            ]
            return
        from jax._src import shard_map as shard_map_internal

        manual = params.get("newly_manual_axes", params.get("manual_axes"))
        if manual is None:  # renamed again: binding no axis would fail on the body's collectives
            raise CannotRebuild("shard_map equation without newly_manual_axes/manual_axes")
        # 0.6.x's _as_manual_mesh wants every manual axis (its staging rule adds
        # mesh.manual_axes); 0.7+ keeps the mesh's manual axes anyway, so adding them there
        # changes nothing.
        all_manual = frozenset(manual) | frozenset(mesh.manual_axes)
        check = getattr(config, "_check_vma", None)
        self._enter = [
            lambda: shard_map_internal._extend_axis_env(mesh, manual),
            lambda: use_abstract_mesh(shard_map_internal._as_manual_mesh(mesh, all_manual)),
            *([lambda: check(params.get("check_vma", True))] if check is not None else []),
        ]

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        for make in self._enter:
            stack.enter_context(make())
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stacks.pop().__exit__(*exc)


def saved_residuals(f: Callable[..., Any], *args: Any) -> list[tuple[Any, bool]]:
    """What reverse-mode AD of `f` at `args` saves for the backward pass: (aval, whether it
    is one of the arguments itself) per residual (``jax.ad_checkpoint.print_saved_residuals``
    prints these; the list is private in 0.6-0.10)."""
    from jax._src.ad_checkpoint import saved_residuals as residuals

    return [(aval, "from the argument" in why) for aval, why in residuals(f, *args)]


def summarize_source(source_info: Any) -> str:
    """'file:line (function)' of the user's frame that made an equation (JAX 0.6-0.10)."""
    return source_info_util.summarize(source_info)


# -- fused kernels (mpjax/_src/interpreter/kernels.py) -----------------------------------------


def nn_functions() -> Any:
    """The module whose ``dot_product_attention`` is ``jax.nn.dot_product_attention``: it
    looks up ``cudnn_dot_product_attention`` (cuDNN's fused attention, which refuses float32
    operands when traced) by name at each call, in 0.6-0.10."""
    from jax._src.nn import functions

    return functions


def traces_apart() -> contextlib.AbstractContextManager[Any]:
    """A context in which JAX keys its trace caches (jit's, scan's) apart from outside it,
    with no other effect: the HLO source-file regex is part of every cache key from 0.6 to
    0.10, and a regex that matches nothing (or the user's own, with an alternative that never
    matches) renames no file."""
    from jax._src import config

    state = config.hlo_source_file_canonicalization_regex
    current = state.value
    never = "(?!)mpjax-kernels"
    return state(never if current is None else f"(?:{current})|{never}")
