"""Checkpoints that remember their precision policy (orbax-checkpoint underneath).

``save`` writes a pytree (params, optimizer state with its loss scale, step, ...) and the
policy it was trained under; ``restore`` refuses to load it into another level or dtype,
because params and loss-scale state are stored per policy (float16 params at O3, a dynamic
scale only for float16) and a silent cast would lose or invent state.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from mpjax._src.float8.fp8 import FP8Policy
from mpjax._src.policy import Policy

_POLICY_FILE = "mpjax_policy.json"
_STATE_DIR = "state"


def _describe(policy: Policy | FP8Policy) -> dict[str, Any]:
    if isinstance(policy, FP8Policy):  # the base policy, and the recipe of its FP8 state
        return {**_describe(policy.base), "fp8_recipe": repr(policy.recipe)}
    return {
        "level": policy.level,
        "param_dtype": np.dtype(policy.param_dtype).name,
        "compute_dtype": np.dtype(policy.compute_dtype).name,
        "output_dtype": np.dtype(policy.output_dtype).name,
    }


def _label(d: dict[str, Any]) -> str:
    level = d.get("level") or "custom"
    fp8 = f", FP8 {d['fp8_recipe']}" if "fp8_recipe" in d else ""
    return (
        f"{level} (params {d['param_dtype']}, compute {d['compute_dtype']}, "
        f"output {d['output_dtype']}{fp8})"
    )


def save(directory: str | os.PathLike, tree: Any, policy: Policy | FP8Policy) -> None:
    """Saves `tree` and `policy` to `directory` (which must not exist yet).

    Args:
      directory: where to write; an absolute path is safest (orbax requires one).
      tree: any pytree of arrays, e.g. ``{"params": params, "opt_state": opt_state}``.
      policy: the policy the state was trained under (an ``mpjax.fp8`` policy too: its
        recipe is saved beside the base policy, and the tree may hold its FP8 state).

    Example:
      >>> import os, tempfile, jax.numpy as jnp, optax, mpjax, mpjax.checkpoint
      >>> policy = mpjax.Policy.from_level("O2", "float16")
      >>> tx = mpjax.loss_scale(optax.sgd(0.1))
      >>> state = {"params": {"w": jnp.ones(2)}, "opt": tx.init({"w": jnp.ones(2)})}
      >>> path = os.path.join(tempfile.mkdtemp(), "step_100")
      >>> mpjax.checkpoint.save(path, state, policy)
      >>> restored = mpjax.checkpoint.restore(path, state, policy)
      >>> float(mpjax.get_loss_scale(restored["opt"]).loss_scale)
      32768.0
    """
    if not isinstance(policy, (Policy, FP8Policy)):
        raise TypeError(f"save needs the mpjax.Policy the state was trained under, got {policy!r}.")
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory):
        raise ValueError(f"{directory} already exists; checkpoints are never overwritten.")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, _STATE_DIR), tree)
    checkpointer.wait_until_finished()
    with open(os.path.join(directory, _POLICY_FILE), "w") as f:
        json.dump(_describe(policy), f)


def saved_policy(directory: str | os.PathLike) -> dict[str, Any]:
    """The level and dtypes a checkpoint was saved under.

    Example:
      >>> import os, tempfile, jax.numpy as jnp, mpjax, mpjax.checkpoint
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
      >>> mpjax.checkpoint.save(path, {"w": jnp.ones(2)}, mpjax.Policy.from_level("O1", "float16"))
      >>> mpjax.checkpoint.saved_policy(path)["level"]
      'O1'
    """
    path = os.path.join(os.path.abspath(os.fspath(directory)), _POLICY_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"No mpjax checkpoint at {os.fspath(directory)} (no {_POLICY_FILE}); write one with "
            "mpjax.checkpoint.save(directory, tree, policy)."
        )
    with open(path) as f:
        return json.load(f)


def restore(directory: str | os.PathLike, target: Any, policy: Policy | FP8Policy) -> Any:
    """Restores the tree saved in `directory` into the structure and dtypes of `target`.

    Args:
      directory: a directory written by :func:`save`.
      target: a pytree like the saved one (arrays or ``jax.ShapeDtypeStruct``), e.g. a freshly
        initialised state; it gives the structure, static fields (loss-scale knobs) and
        shardings.
      policy: the policy to resume under; it must be the one the checkpoint was saved under.

    Returns:
      The restored pytree.

    Raises:
      FileNotFoundError: if `directory` is not an mpjax checkpoint.
      ValueError: if `policy` differs from the saved one in level or any dtype.

    Example:
      >>> import os, tempfile, jax.numpy as jnp, mpjax, mpjax.checkpoint
      >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
      >>> policy = mpjax.Policy.from_level("O2", "bfloat16")
      >>> mpjax.checkpoint.save(path, {"w": jnp.arange(3.0)}, policy)
      >>> mpjax.checkpoint.restore(path, {"w": jnp.zeros(3)}, policy)["w"]
      Array([0., 1., 2.], dtype=float32)
    """
    saved = saved_policy(directory)
    wanted = _describe(policy)
    if saved != wanted:
        raise ValueError(
            f"The checkpoint at {os.fspath(directory)} was saved under {_label(saved)}, but you "
            f"restore it under {_label(wanted)}. Params and loss-scale state are stored per "
            "policy, so restore with the saved policy, then convert explicitly: "
            "new_policy.cast_to_param(params) and a fresh optimizer state (tx.init)."
        )
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    checkpointer = ocp.StandardCheckpointer()
    path = os.path.join(os.path.abspath(os.fspath(directory)), _STATE_DIR)
    try:
        return checkpointer.restore(path, abstract)
    except ValueError as e:  # orbax's own words suggest options restore does not take
        mismatch = _structure_mismatch(checkpointer, path, target)
        if mismatch is None:
            raise
        raise ValueError(
            f"The checkpoint at {os.fspath(directory)} does not have the target's structure: "
            f"{mismatch} Build the target as the saved state was built (the same params and "
            "the same optimizer, e.g. tx.init(params) for the same tx), then restore."
        ) from e


# The fields only mpjax.loss_scale's state has (LossScaleState).
_LOSS_SCALE_FIELDS = ("skipped_steps", "consecutive_skips", "last_finite")


def _leaf_paths(tree: Any) -> set[str]:
    def name(key: Any) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(name(k) for k in path) for path, _ in flat}


def _structure_mismatch(checkpointer: Any, path: str, target: Any) -> str | None:
    """What differs between the saved tree and `target`, in words; None if unknown."""
    try:
        metadata = checkpointer.metadata(path)
        saved_tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", None)
        saved = _leaf_paths(saved_tree if saved_tree is not None else metadata)
    except Exception:  # noqa: BLE001 - no readable metadata: keep orbax's error
        return None
    wanted = _leaf_paths(target)
    if saved == wanted:
        return None
    has = lambda paths: any(p.rsplit("/", 1)[-1] in _LOSS_SCALE_FIELDS for p in paths)
    if has(saved) and not has(wanted):
        return (
            "it holds a loss-scale state (an optimizer wrapped in mpjax.loss_scale) and the "
            "target does not: wrap the target's optimizer the same way."
        )
    if has(wanted) and not has(saved):
        return (
            "the target holds a loss-scale state (mpjax.loss_scale) and the checkpoint does "
            "not: it was saved from an optimizer without loss scaling."
        )
    only_saved, only_wanted = sorted(saved - wanted)[:3], sorted(wanted - saved)[:3]
    return f"only in the checkpoint: {only_saved}; only in the target: {only_wanted}."


__all__ = ["restore", "save", "saved_policy"]
