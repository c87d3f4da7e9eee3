"""Regions of a program under another precision: ``full_precision`` and ``half_precision``
(``jax.named_scope`` markers, so they survive jit, grad and vmap), and the region keys that
per-module rules of the Flax wrappers put in name stacks."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import re
import threading
from collections.abc import Iterator
from typing import Any

import jax

from mpjax._src.policy import Policy

MARKER = re.compile(r"mpjax:([A-Za-z0-9_]+)")
F32_REGION, HALF_REGION = "f32", "half"


# The markers of the regions entered, innermost last, while a program is traced: JAX starts
# each sub-trace (a jit, scan, remat or custom_vjp body) with an empty name stack, so a fused
# kernel traced in one reads its region here (kernels.py).
_ENTERED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "mpjax_regions", default=()
)


@contextlib.contextmanager
def marker_scope(marker: str) -> Iterator[None]:
    """The ``mpjax:<marker>`` name scope of a region (see :func:`entered`)."""
    token = _ENTERED.set((*_ENTERED.get(), marker))
    try:
        with jax.named_scope(f"mpjax:{marker}"):
            yield
    finally:
        _ENTERED.reset(token)


def entered() -> str:
    """The region markers in force where a program is being traced, as a name stack has them."""
    return "/".join(f"mpjax:{m}" for m in _ENTERED.get())


class _Region:
    """A region marker usable as ``with marker():``, ``@marker()`` and ``with marker:``.

    The first two are the documented forms (as ``jax.named_scope``); the bare ``with
    marker:`` is what people write from torch's ``with torch.autocast(...)``, and it works
    the same rather than failing with "object does not support the context manager
    protocol"."""

    def __init__(self, marker: str, doc: str) -> None:
        self._marker = marker
        self._entered = threading.local()
        self.__doc__ = doc

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        return marker_scope(self._marker)

    def __enter__(self) -> None:
        scope = marker_scope(self._marker)
        scope.__enter__()
        self._entered.__dict__.setdefault("stack", []).append(scope)

    def __exit__(self, *exc: Any) -> Any:
        return self._entered.stack.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"mpjax.{'full' if self._marker == F32_REGION else 'half'}_precision"


full_precision = _Region(
    F32_REGION,
    """Keeps a region in float32 under :func:`autocast` (torch's nested ``autocast(False)``).

    Use as a context manager (``with mpjax.full_precision():``, or without the parentheses)
    or a decorator (``@mpjax.full_precision()``). Outside autocast it changes nothing.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> def f(x):
      ...     with mpjax.full_precision():
      ...         return jnp.exp(x @ x)
      >>> policy = mpjax.Policy.from_level("O2", "bfloat16")
      >>> mpjax.autocast(f, policy)(jnp.ones((2, 2))).dtype
      dtype('float32')
    """,
)

half_precision = _Region(
    HALF_REGION,
    """Forces a region into the policy's half dtype under :func:`autocast` (f32 list included).

    Use as a context manager (``with mpjax.half_precision():``, or without the parentheses)
    or a decorator (``@mpjax.half_precision()``).

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> @mpjax.half_precision()
      ... def g(x):
      ...     return jnp.exp(x)
      >>> policy = mpjax.Policy.from_level("O2", "bfloat16").with_output_dtype("bfloat16")
      >>> mpjax.autocast(g, policy)(jnp.ones(2)).dtype
      dtype(bfloat16)
    """,
)


# Region keys made by region_key(): an enclosing interpreter that was not given the rules (a
# function of a wrapped model under another autocast or under mpjax.fp8) still applies them.
REGIONS: dict[str, Policy] = {}
_REGION_COUNT = itertools.count()


def region_key(policy: Policy) -> str:
    """A process-unique region key for `policy`, known to every autocast evaluation."""
    key = f"r{next(_REGION_COUNT)}"
    REGIONS[key] = policy
    return key
