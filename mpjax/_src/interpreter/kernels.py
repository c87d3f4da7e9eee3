"""Fused kernels under the policy: cuDNN's flash attention and Pallas kernels run in half.

A kernel fixes its dtypes when it is traced: cuDNN's fused attention refuses float32 operands
right there, and a Pallas kernel is traced for the dtypes of its refs. So autocast cannot
recast one from the jaxpr, as it does every other op. Instead, while autocast traces a
function (and only then), the kernels' entry points are called with the half operands the
policy gives them, as torch.amp casts the operands of ``scaled_dot_product_attention`` before
its fused kernel runs:

- ``jax.nn.dot_product_attention``'s cuDNN path (``implementation="cudnn"``);
- the outermost ``jax.custom_vjp`` function that calls a Pallas kernel (splash and flash
  attention, a user's own kernel with its backward kernels). Its float operands are cast, not
  each ``pallas_call``'s, so that the dtypes the kernel's author derives from the operands
  (its output's, its residuals') come out as in the hand-written half step, and what the
  author wrote as float32 (a logsumexp, a scratch) stays float32;
- a ``pallas_call`` that no ``custom_vjp`` encloses: its float32 operands and results in half.

A kernel runs in half where the policy runs matmuls in half (``dot_general`` on the lower
list: O1 to O3, and ``half_precision`` regions); elsewhere (a ``full_precision`` region) it is
called as written. One that cannot take half operands (a dtype check, a float32-only
scratch) runs as traced, in float32, with an :class:`UntouchedWarning`; the audit lists it.

The half call is traced under the :data:`KERNEL` name scope, and autocast binds what is
under it as traced (those are the kernel's dtypes now). Its half results are cast back to
float32 under :data:`RESULT`, so that the user's function sees the dtypes it was written for;
autocast passes the half values on. Traces made meanwhile are keyed apart in JAX's caches
(``jc.traces_apart``), so a jitted function or scan body traced here is not reused outside.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from mpjax._src import jax_compat as jc
from mpjax._src.dtypes import is_float_dtype
from mpjax._src.interpreter import interpret, regions
from mpjax._src.interpreter.first_order import NO_HALF_KERNEL, UNTOUCHED_SCOPE, UntouchedWarning
from mpjax._src.interpreter.rules import op_lists
from mpjax._src.policy import Policy

# The name scopes of a kernel's half call (bound as traced) and of the casts of its results
# back to float32 (passed on in half). Neither name contains the other.
KERNEL = "mpjax_kernel_call"
RESULT = "mpjax_kernel_result"
# The primitives that are kernels, for a probe's jaxpr: Pallas's, and cuDNN attention's
# (JAX's names for its forward and backward calls, with their wrappers', in 0.6-0.10).
_KERNEL_PRIMITIVES = (
    "pallas_call",
    "dot_product_attention_fwd",
    "dot_product_attention_bwd",
    "dot_product_attention_fwd_wrapper",
    "dot_product_attention_bwd_wrapper",
)


@dataclasses.dataclass
class _Tracing:
    ctx: Any  # autocast's Context: its policy and mode_for
    depth: int = 0  # > 0 inside a kernel's call: nothing more is cast
    probing: bool = False  # tracing a custom_vjp function to find out if it calls a kernel

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


_ACTIVE: contextvars.ContextVar[_Tracing | None] = contextvars.ContextVar(
    "mpjax_kernels", default=None
)


class _KernelSeen(Exception):
    """Raised by a hook while probing: the function calls a kernel."""


@contextlib.contextmanager
def in_half(ctx: Any) -> Iterator[None]:
    """While autocast traces a function: kernels are called with the half operands `ctx`'s
    policy gives them (see the module docstring)."""
    _install()
    token = _ACTIVE.set(_Tracing(ctx))
    try:
        with jc.traces_apart():
            yield
    finally:
        _ACTIVE.reset(token)


def _half_dtype(state: _Tracing) -> np.dtype | None:
    """The dtype a kernel called here runs in: the policy's half where its matmuls run in
    half, else None (as written)."""
    policy: Policy = state.ctx.policy
    # The regions entered, then the name stack (a region named by hand, jax.named_scope).
    where = f"{regions.entered()}/{jc.current_name_stack()}"
    mode = state.ctx.mode_for(policy, where)
    if mode == "half":
        return np.dtype(policy.compute_dtype)
    if isinstance(mode, Policy) and "dot_general" in op_lists(mode)[0]:
        return np.dtype(mode.compute_dtype)
    return None


def _wide_float(dtype: Any) -> bool:
    """A float dtype wider than half."""
    return is_float_dtype(dtype) and np.dtype(dtype).itemsize >= 4


def _castable(x: Any) -> bool:
    """A float array wider than half (scalars stay: a kernel may read them as 32-bit)."""
    return isinstance(x, (jax.Array, np.ndarray)) and _wide_float(x.dtype) and np.ndim(x) >= 1


def _tracing_dtype() -> tuple[_Tracing, np.dtype] | None:
    """For a kernel called now: autocast's tracing state and the dtype to call it in, or None
    where it runs as written (not under autocast, inside a kernel's call, or a region whose
    matmuls are not half). While a custom_vjp function is probed, says it calls a kernel."""
    state = _ACTIVE.get()
    if state is None or state.depth:
        return None
    if state.probing:
        raise _KernelSeen
    dtype = _half_dtype(state)
    return None if dtype is None else (state, dtype)


def _call_in_half(
    state: _Tracing,
    call: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: np.dtype,
    name: str,
    written: Callable[..., Any] | None = None,
) -> Any:
    """`call(*args, **kwargs)` with its float operands in `dtype`, its half results cast back
    to the operands' dtype (see RESULT); as written (`written`, else `call`, on the operands
    as they are), with a warning, where it fails in half."""
    written = call if written is None else written
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    wide = [np.dtype(x.dtype) for x in leaves if _castable(x)]
    if not wide:
        with state.inside():
            return call(*args, **kwargs)
    half_args, half_kwargs = jax.tree_util.tree_unflatten(
        tree, [x.astype(dtype) if _castable(x) else x for x in leaves]
    )
    try:
        with state.inside(), jax.named_scope(KERNEL):
            out = call(*half_args, **half_kwargs)
    except _KernelSeen:
        raise
    except Exception as e:  # noqa: BLE001 - any failure in half: run it as written
        warnings.warn(
            f"mpjax.autocast: the kernel {name} cannot take {dtype.name} operands "
            f"({type(e).__name__}: {e}); it runs as written, in {wide[0].name}. The audit "
            "lists it.",
            UntouchedWarning,
            stacklevel=3,
        )
        scope = f"{UNTOUCHED_SCOPE}:{re.sub(r'[^A-Za-z0-9_.]', '_', name)}:{NO_HALF_KERNEL}"
        with state.inside(), jax.named_scope(KERNEL), jax.named_scope(scope):
            return written(*args, **kwargs)
    to = max(wide, key=lambda d: d.itemsize)
    with jax.named_scope(RESULT):
        return jax.tree_util.tree_map(
            lambda y: y.astype(to) if getattr(y, "dtype", None) == dtype else y, out
        )


def _calls_kernel(state: _Tracing, thunk: Callable[[], Any]) -> bool:
    """Whether `thunk` calls a kernel: traced apart (its equations are dropped), stopped at
    the first kernel a hook sees, or found in its jaxpr (a pallas_call bound directly)."""
    state.probing = True
    try:
        closed = jax.make_jaxpr(thunk)()
    except _KernelSeen:
        return True
    except Exception:  # noqa: BLE001 - not a kernel's: the call itself raises it again
        return False
    finally:
        state.probing = False
    return _has_kernel(closed.jaxpr)


def _has_kernel(jaxpr: Any) -> bool:
    return any(
        eqn.primitive.name in _KERNEL_PRIMITIVES
        or any(_has_kernel(interpret.open_jaxpr(b)[0]) for b in interpret.bodies(eqn))
        for eqn in jaxpr.eqns
    )


# -- the hooks: each a wrapper of a JAX entry point, as written unless autocast is tracing ------

_INSTALLED: set[str] = set()
_INSTALLING = threading.Lock()


def _install() -> None:
    """Installs the hooks once; Pallas's when it has been imported (never imports it)."""
    with _INSTALLING:
        _install_missing()


def _install_missing() -> None:
    if "cudnn" not in _INSTALLED:
        functions = jc.nn_functions()
        functions.cudnn_dot_product_attention = _cudnn_hook(functions.cudnn_dot_product_attention)
        _INSTALLED.add("cudnn")
    if "custom_vjp" not in _INSTALLED:
        jax.custom_vjp.__call__ = _custom_vjp_hook(jax.custom_vjp.__call__)  # type: ignore[method-assign]
        _INSTALLED.add("custom_vjp")
    pallas: Any = sys.modules.get("jax.experimental.pallas")
    if pallas is not None and "pallas" not in _INSTALLED:
        pallas.pallas_call = _pallas_hook(pallas.pallas_call)
        _INSTALLED.add("pallas")


def _cudnn_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def cudnn_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        tracing = _tracing_dtype()
        if tracing is None:
            return original(*args, **kwargs)
        state, dtype = tracing
        return _call_in_half(state, original, args, kwargs, dtype, "cudnn_dot_product_attention")

    return cudnn_dot_product_attention


def _custom_vjp_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        state = _ACTIVE.get()
        # Only a program that has imported Pallas is probed: the rest pay nothing.
        if state is None or state.depth or state.probing or "pallas" not in _INSTALLED:
            return original(self, *args, **kwargs)
        dtype = _half_dtype(state)
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if dtype is None or not any(_castable(x) for x in leaves):
            with state.inside():  # as written, the kernels inside too
                return original(self, *args, **kwargs)
        if not _calls_kernel(state, lambda: original(self, *args, **kwargs)):
            with state.inside():
                return original(self, *args, **kwargs)
        name = getattr(self, "__name__", None) or type(self).__name__
        call = functools.partial(original, self)
        return _call_in_half(state, call, args, kwargs, dtype, name)

    return __call__


def _pallas_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def pallas_call(kernel: Any, *args: Any, **kwargs: Any) -> Any:
        made = original(kernel, *args, **kwargs)

        @functools.wraps(made)
        def call(*operands: Any) -> Any:
            tracing = _tracing_dtype()
            if tracing is None:
                return made(*operands)
            state, dtype = tracing
            half_made = functools.partial(_half_pallas_call, original, kernel, args, kwargs, dtype)
            name = getattr(kernel, "__name__", None) or "pallas_call"
            return _call_in_half(state, half_made, operands, {}, dtype, name, made)

        return call

    return pallas_call


def _half_pallas_call(
    original: Callable[..., Any],
    kernel: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: np.dtype,
    *operands: Any,
) -> Any:
    """A pallas_call no custom_vjp encloses, on half `operands`, its float32 results made in
    `dtype` too. A result its author writes in float32 whatever the operands (a logsumexp)
    fails that (its store's dtype differs): then each result in turn is left float32, the
    first that traces is kept; if none does, the failure is the caller's to report."""
    spec = args[0] if args else kwargs.get("out_shape")
    wide = [
        i
        for i, x in enumerate(jax.tree_util.tree_leaves(spec, is_leaf=_is_shape))
        if _is_shape(x) and _wide_float(x.dtype)
    ]
    failure: Exception | None = None
    for keep in [None, *wide]:
        halved = _halved(spec, dtype, keep)
        new_args, new_kwargs = (
            ((halved, *args[1:]), kwargs) if args else (args, {**kwargs, "out_shape": halved})
        )
        try:
            return original(kernel, *new_args, **new_kwargs)(*operands)
        except _KernelSeen:
            raise
        except Exception as e:  # noqa: BLE001 - try the next plan; the last error is reported
            failure = e
    assert failure is not None
    raise failure


def _is_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _halved(spec: Any, dtype: np.dtype, keep: int | None = None) -> Any:
    """`spec` (pallas_call's out_shape) with its float32 shapes in `dtype`, but the `keep`-th
    leaf."""
    leaves, tree = jax.tree_util.tree_flatten(spec, is_leaf=_is_shape)
    halved = [
        jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        if _is_shape(x) and _wide_float(x.dtype) and i != keep
        else x
        for i, x in enumerate(leaves)
    ]
    return jax.tree_util.tree_unflatten(tree, halved)
