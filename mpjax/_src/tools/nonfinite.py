"""find_nonfinite: the first op that made an inf or nan from finite operands, found by running
a function op by op on the interpreter core."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src import jax_compat
from mpjax._src.interpreter import interpret


@dataclasses.dataclass(frozen=True)
class NonFiniteOrigin:
    """The first op of a function that made an inf or nan from finite inputs.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> origin = mpjax.find_nonfinite(lambda x: jnp.sqrt(x - 2.0), jnp.ones(2))
      >>> origin.primitive, origin.kind, origin.shape
      ('sqrt', 'nan', (2,))"""

    primitive: str
    name: str
    source: str | None
    dtype: str
    shape: tuple[int, ...]
    kind: str

    def __str__(self) -> str:
        what = f"{self.dtype}{list(self.shape)}"
        if self.primitive == "input":
            return f"{self.kind} in the input {self.name} ({what})"
        if self.primitive == "constant":
            return f"{self.kind} in a constant the function closes over ({what})"
        return (
            f"{self.kind} first produced by {self.primitive} -> {what} "
            f"in {self.name or '<top level>'} at {self.source or 'unknown source'}"
        )


def nonfinite_kind(x: Any) -> str | None:
    """'nan' or 'inf' if the floating array `x` holds one (nan first), else None."""
    # jnp.issubdtype, not np: a PRNG key's dtype (key<fry>) is not a NumPy dtype.
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)):
        return None
    arr = np.asarray(x, np.float64) if np.dtype(x.dtype).itemsize <= 8 else np.asarray(x)
    if np.isnan(arr).any():
        return "nan"
    if np.isinf(arr).any():
        return "inf"
    return None


def _nonfinite_input(
    named: list[tuple[str, Any]], primitive: str, kinds: tuple[str, ...] = ("nan", "inf")
) -> NonFiniteOrigin | None:
    """The first of `named` (name, value) holding one of `kinds`, as an origin."""
    for name, x in named:
        kind = nonfinite_kind(x)
        if kind in kinds:
            return NonFiniteOrigin(
                primitive=primitive,
                name=name,
                source=None,
                dtype=str(np.dtype(x.dtype)),
                shape=tuple(np.shape(x)),
                kind=kind,
            )
    return None


class _Found(Exception):
    def __init__(self, origin: NonFiniteOrigin):
        self.origin = origin


def _first_nonfinite(jaxpr: Any, consts: list, args: list, stack: str) -> list[Any]:
    """Evaluates `jaxpr` eagerly; raises _Found at the first op that made an inf or nan from
    finite operands. A call with finite operands is entered, to name the op inside."""

    def step(eqn: Any, invals: list[Any]) -> list[Any]:
        name = "/".join(p for p in (stack, str(eqn.source_info.name_stack)) if p)
        finite_in = all(nonfinite_kind(x) is None for x in invals)
        body = interpret.call_body(eqn)
        if body is not None and finite_in:
            return _first_nonfinite(*interpret.open_jaxpr(body), invals, name)
        outs = jax_compat.bind(eqn.primitive, invals, eqn.params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        kinds = [nonfinite_kind(x) for x in outs]
        if any(kinds) and finite_in:
            out = outs[[k is not None for k in kinds].index(True)]
            raise _Found(
                NonFiniteOrigin(
                    primitive=eqn.primitive.name,
                    name=name,
                    source=jax_compat.summarize_source(eqn.source_info),
                    dtype=np.dtype(out.dtype).name,
                    shape=tuple(out.shape),
                    kind=next(k for k in kinds if k),
                )
            )
        return outs

    return interpret.forward(jaxpr, interpret.Env(jaxpr, consts, args), step)


def find_nonfinite(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NonFiniteOrigin | None:
    """Runs `fn` op by op (eagerly, for debugging) and names the first op that produced an
    inf or nan from finite inputs, with its source line. Returns None if every value is finite.

    When no op made one, an inf or nan that came in with the arguments is reported:
    ``primitive`` is ``"input"`` and ``name`` the argument's path (``"args[1]['x']"``); then a
    nan in a value `fn` closes over (``"constant"``; an inf there is usually a mask's fill).

    For when even O0 diverges: ``mpjax.find_nonfinite(loss_fn, params, batch)``. Wrap `fn` in
    :func:`mpjax.autocast` to debug it under a policy. Arguments must be arrays or pytrees of
    arrays. It recurses into jit, custom_jvp/vjp and remat; loops run whole.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> def f(x):
      ...     return jnp.log(x - 1.0).sum()
      >>> origin = mpjax.find_nonfinite(f, jnp.array([2.0, 1.0]))
      >>> origin.primitive, origin.kind
      ('log', 'inf')
    """
    if not callable(fn):
        raise TypeError(f"find_nonfinite needs a function, got {type(fn).__name__}.")
    paths, _ = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in paths]
    for leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, float, int, bool)):
            raise TypeError(
                f"find_nonfinite takes arrays (or pytrees of arrays), got a {type(leaf).__name__}; "
                "close over other arguments with functools.partial."
            )
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    found: NonFiniteOrigin | None = None
    try:
        _first_nonfinite(closed.jaxpr, list(closed.consts), leaves, "")
    except _Found as e:
        found = e.origin
    if found is None:
        found = _nonfinite_input(
            [(("args", "kwargs")[p[0].idx] + jax.tree_util.keystr(p[1:]), x) for p, x in paths],
            "input",
        )
    if found is None:  # an inf constant is usually a mask's fill: only a nan is reported
        found = _nonfinite_input([("", c) for c in closed.consts], "constant", kinds=("nan",))
    return found
