"""Mixed-precision inference: convert trained params for half inference, export the function
with ``jax.export`` (serialized StableHLO) together with its params, and load both in a
process that has none of the model's Python code.

MXNet's AMP ``convert_model``/``cast_optional_params`` is the peer: a param that only feeds
lower-list ops (matmuls, convolutions) is stored in half; one that feeds anything else (a
bias add, a norm scale) stays float32. At O3 every float param is stored in half, and at O0
nothing changes.

    params16 = mpjax.export.convert(model.apply, params, policy, x)
    mpjax.export.save("digits_o2", model.apply, params16, x, policy=policy)
    predict = mpjax.export.load("digits_o2")        # in any process: predict(x)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export  # JAX 0.6 does not load it as an attribute of jax

from mpjax._src import jax_compat as jc
from mpjax._src import levels
from mpjax._src.interpreter import interpret
from mpjax._src.interpreter.autocast_api import autocast
from mpjax._src.interpreter.rules import MOVE_OPS
from mpjax._src.policy import Policy

_FORMAT = 1
_FUNCTION_FILE = "function.stablehlo"
_PARAMS_FILE = "params.npz"
_META_FILE = "export.json"


# -- which params only feed lower-list ops: a use analysis on the interpreter core ---------------
#
# A backward walk marks each variable with whether every use of it ends in a lower-list op
# (through ops that pass it on unchanged in value, its shape or dtype aside, and inlined
# calls). Each rule gives, from the marks of its equation's results, those of its operands.
_LOWER_ONLY = interpret.Registry(
    default=lambda eqn, outs_only, lower_ops: [False] * len(eqn.invars)
)


@_LOWER_ONLY.register(*MOVE_OPS, "convert_element_type")
def _passes_on(eqn: Any, outs_only: list[bool], lower_ops: frozenset[str]) -> list[bool]:
    return [all(outs_only)] * len(eqn.invars)


@_LOWER_ONLY.register(*interpret.CALL.names)
def _call_uses(eqn: Any, outs_only: list[bool], lower_ops: frozenset[str]) -> list[bool]:
    inner = interpret.open_jaxpr(interpret.CALL.body(eqn))[0]
    return _only_feeds(inner, lower_ops)


def _only_feeds(jaxpr: Any, lower_ops: frozenset[str]) -> list[bool]:
    """For each input of `jaxpr`: whether it is used, and every use ends in a lower-list op."""
    only: dict[Any, bool] = {}

    def use(v: Any, flag: bool) -> None:
        if not isinstance(v, jc.Literal):
            only[v] = only.get(v, True) and flag

    for v in jaxpr.outvars:
        use(v, False)

    def step(eqn: Any) -> None:
        if eqn.primitive.name in lower_ops:
            flags = [True] * len(eqn.invars)
        else:
            outs_only = [only.get(v, False) for v in eqn.outvars]
            flags = _LOWER_ONLY(eqn)(eqn, outs_only, lower_ops)
        for v, f in zip(eqn.invars, flags, strict=True):
            use(v, f)

    interpret.backward(jaxpr, step)
    return [only.get(v, False) for v in jaxpr.invars]


def half_param_paths(fn: Callable[..., Any], params: Any, policy: Policy, *args: Any) -> list[str]:
    """The paths of the float params of ``fn(params, *args)`` that only feed lower-list ops.

    Example:
      >>> import jax.numpy as jnp, mpjax, mpjax.export
      >>> f = lambda p, x: x @ p["w"] + p["b"]
      >>> mpjax.export.half_param_paths(f, {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)},
      ...                               mpjax.Policy.from_level("O1"), jnp.ones((4, 3)))
      ["['w']"]"""
    closed = jax.make_jaxpr(fn)(params, *args)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    only = _only_feeds(closed.jaxpr, policy.lower_ops)[: len(flat)]
    return [
        jax.tree_util.keystr(path)
        for (path, leaf), lower_only in zip(flat, only, strict=True)
        if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating) and lower_only
    ]


def convert(fn: Callable[..., Any], params: Any, policy: Policy, *args: Any) -> Any:
    """Returns `params` stored for half inference under `policy`.

    At O1/O2 a float param that only feeds lower-list ops (``policy.lower_ops``) is cast to
    ``policy.compute_dtype``; the others stay as they are. At O3 every float param is cast to
    half; at O0 (or a float32 policy) `params` come back unchanged.

    Args:
      fn: the inference function, called as ``fn(params, *args)`` (e.g. ``model.apply``).
      params: the trained params (float32).
      policy: the inference policy, e.g. ``Policy.from_level("O2", "bfloat16")``.
      *args: example inputs (arrays or ``jax.ShapeDtypeStruct``), to trace `fn`.

    Example:
      >>> import jax.numpy as jnp, mpjax, mpjax.export
      >>> def f(p, x):
      ...     return x @ p["w"] + p["b"]
      >>> p = mpjax.export.convert(f, {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)},
      ...                          mpjax.Policy.from_level("O2", "bfloat16"), jnp.ones((4, 3)))
      >>> p["w"].dtype, p["b"].dtype
      (dtype(bfloat16), dtype('float32'))
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"convert needs an mpjax.Policy, got {type(policy).__name__}.")
    if not levels.casts(policy):
        return params
    if levels.of(policy).all_half:
        return policy.cast_to_param(params)
    half = set(half_param_paths(fn, params, policy, *args))

    def cast(path: Any, leaf: Any) -> Any:
        if jax.tree_util.keystr(path) in half:
            return jnp.asarray(leaf, policy.compute_dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(cast, params)


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
    return jax.ShapeDtypeStruct(np.shape(x), dtype)


def save(
    directory: str | os.PathLike,
    fn: Callable[..., Any],
    params: Any,
    *args: Any,
    policy: Policy,
) -> dict[str, Any]:
    """Exports ``autocast(fn, policy)`` as serialized StableHLO, with `params`, to `directory`.

    Args:
      directory: a new directory.
      fn: the inference function ``fn(params, *args)``.
      params: the params to ship (usually :func:`convert`'s output).
      *args: example inputs; their shapes and dtypes are the exported signature.
      policy: the policy to run under.

    Returns:
      A summary: bytes on disk of the params and the function, and the params' dtypes.

    Example:
      >>> import os, tempfile, jax.numpy as jnp, mpjax, mpjax.export
      >>> f = lambda p, x: x @ p["w"]
      >>> path = os.path.join(tempfile.mkdtemp(), "f")
      >>> policy = mpjax.Policy.from_level("O2", "bfloat16")
      >>> mpjax.export.save(path, f, {"w": jnp.ones((3, 2), jnp.bfloat16)}, jnp.ones((4, 3)),
      ...                   policy=policy)["dtypes"]
      ['bfloat16']
      >>> mpjax.export.load(path)(jnp.ones((4, 3)))
      Array([[3., 3.],
             [3., 3.],
             [3., 3.],
             [3., 3.]], dtype=float32)
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"save needs policy=mpjax.Policy, got {type(policy).__name__}.")
    directory = os.fspath(directory)
    if os.path.exists(directory):
        raise ValueError(f"{directory} already exists; exports are never overwritten.")
    infer = autocast(fn, policy) if levels.of(policy).interprets else fn
    specs = jax.tree_util.tree_map(_spec, (params, *args))
    exported = jax_export.export(jax.jit(infer))(*specs)
    os.makedirs(directory)
    with open(os.path.join(directory, _FUNCTION_FILE), "wb") as f:
        f.write(exported.serialize())
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    arrays: dict[str, Any] = {}
    leaves = []
    for i, (path, leaf) in enumerate(flat):
        arr = np.asarray(leaf)
        # npz cannot hold bfloat16: store the raw bits and the dtype's name.
        arrays[f"p{i}"] = arr.view(np.uint16) if arr.dtype.itemsize == 2 else arr
        leaves.append(
            {"path": jax.tree_util.keystr(path), "dtype": arr.dtype.name, "shape": list(arr.shape)}
        )
    np.savez(os.path.join(directory, _PARAMS_FILE), allow_pickle=False, **arrays)
    meta = {
        "format": _FORMAT,
        "policy": str(policy),
        "level": policy.level,
        "leaves": leaves,
        "args": [{"shape": list(s.shape), "dtype": np.dtype(s.dtype).name} for s in specs[1:]],
    }
    with open(os.path.join(directory, _META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    return {
        "params_bytes": os.path.getsize(os.path.join(directory, _PARAMS_FILE)),
        "function_bytes": os.path.getsize(os.path.join(directory, _FUNCTION_FILE)),
        "dtypes": sorted({leaf["dtype"] for leaf in leaves}),
    }


def load(directory: str | os.PathLike, params: Any = None) -> Callable[..., Any]:
    """Loads an export: returns ``predict(*args)`` running the saved function on its params.

    Needs no model code: the function is StableHLO and the params are arrays.

    Args:
      directory: written by :func:`save`.
      params: optional params to use instead of the saved ones; they must match the exported
        signature (structure, shapes and dtypes), or a ValueError says what differs.

    Raises:
      FileNotFoundError: if a file of the export is missing.
      ValueError: if the params do not match the exported function.

    Example:
      >>> import os, tempfile, jax.numpy as jnp, mpjax, mpjax.export
      >>> path, x = os.path.join(tempfile.mkdtemp(), "f"), jnp.ones((4, 3))
      >>> _ = mpjax.export.save(path, lambda p, x: x @ p["w"], {"w": jnp.ones((3, 2))}, x,
      ...                       policy=mpjax.Policy.from_level("O2", "bfloat16"))
      >>> mpjax.export.load(path)(x)[0, 0].item()
      3.0
      >>> mpjax.export.load(path, params={"w": jnp.full((3, 2), 2.0)})(x)[0, 0].item()
      6.0
    """
    directory = os.fspath(directory)
    for name in (_FUNCTION_FILE, _PARAMS_FILE, _META_FILE):
        if not os.path.exists(os.path.join(directory, name)):
            raise FileNotFoundError(
                f"{os.path.join(directory, name)} is missing: {directory} is not a complete "
                "mpjax export (write one with mpjax.export.save)."
            )
    with open(os.path.join(directory, _META_FILE)) as meta_file:
        meta = json.load(meta_file)
    with open(os.path.join(directory, _FUNCTION_FILE), "rb") as function_file:
        exported = jax_export.deserialize(bytearray(function_file.read()))
    in_tree: Any = exported.in_tree  # ((params, *args), {})
    params_tree = in_tree.children()[0].children()[0]
    params_avals = exported.in_avals[: params_tree.num_leaves]
    if params is None:
        with np.load(os.path.join(directory, _PARAMS_FILE)) as data:
            leaves = []
            for i, info in enumerate(meta["leaves"]):
                arr = data[f"p{i}"]
                dtype = jnp.dtype(info["dtype"])
                leaves.append(jnp.asarray(arr.view(dtype) if arr.dtype != dtype else arr))
        params = jax.tree_util.tree_unflatten(params_tree, leaves)
    _check_params(params, params_tree, params_avals, meta)

    def predict(*args: Any) -> Any:
        return exported.call(params, *args)

    predict.__doc__ = f"Exported inference function ({meta['policy']}, level {meta['level']})."
    return predict


def _check_params(params: Any, tree: Any, avals: Any, meta: dict[str, Any]) -> None:
    got: Any = jax.tree_util.tree_structure(params)
    if got != tree:
        raise ValueError(
            f"The params do not match the exported function: it takes a tree {tree}, got {got}."
        )
    leaves = jax.tree_util.tree_leaves(params)
    for leaf, aval, info in zip(leaves, avals, meta["leaves"], strict=True):
        shape, dtype = tuple(np.shape(leaf)), jnp.asarray(leaf).dtype
        if shape != tuple(aval.shape) or dtype != aval.dtype:
            raise ValueError(
                f"The params do not match the exported function: {info['path']} is "
                f"{dtype}{list(shape)}, but it was exported as {aval.dtype}{list(aval.shape)}."
            )


__all__ = ["convert", "half_param_paths", "load", "save"]
