"""Flax module paths in a trace's name stacks, for mpjax.compare: every linen method call and
every call of a wrapped NNX model's modules runs in a scope named by its path."""

from __future__ import annotations

import contextlib
import fnmatch
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax

from mpjax._src.interpreter.first_order import UNTOUCHED_SCOPE
from mpjax._src.interpreter.regions import F32_REGION, marker_scope, region_key
from mpjax._src.policy import Policy

# Module paths travel in the name stack as this scope (``/`` would split it into parts).
_MODULE_SCOPE = "mpjax_module:"
_MODULE_RE = re.compile(re.escape(_MODULE_SCOPE) + r"([^/()]*)")


# -- reading a module path out of a name stack -------------------------------------------------

# The parts of a name stack that JAX adds: transformations wrapping the scope they entered
# (``transpose(jvp(Net))``), function calls (``jit(step)``, ``pmap(f)``), and the regions of
# control flow and remat. What is left is what the user's code named: Flax's module path
# (``Net/Dense_0``) and any ``jax.named_scope``.
_TRANSFORM = re.compile(r"(?:jvp|transpose|vmap)\((.*)\)")
_CALL_SCOPE = re.compile(r"\w+\(.*\)")
_JAX_SCOPE = re.compile(r"cond|while|body|body_pred|branch_\d+_fun|checkpoint|rematted_computation")


def module_path(name_stack: str) -> str | None:
    """The module path in a name stack (its scopes, no primitive), ``Net/Dense_0`` from
    ``jit(step)/transpose(jvp(Net))/Dense_0``; None where it has none."""
    path: list[str] = []
    for part in name_stack.split("/"):
        while (m := _TRANSFORM.fullmatch(part)) is not None:
            part = m.group(1)
        if not part or _CALL_SCOPE.fullmatch(part) or _JAX_SCOPE.fullmatch(part):
            continue
        if part.startswith(("mpjax:", UNTOUCHED_SCOPE + ":")):
            continue
        if not path or path[-1] != part:  # a transformation re-entering the same module
            path.append(part)
    return "/".join(path) or None


def glob_path(path: str, pattern: str) -> bool:
    """Whether a module path matches a rule's glob (``"decoder/*"`` matches ``"decoder"`` too)."""
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path + "/", pattern)


# -- tracing: the program, with module paths and float32 regions marked ------------------------

_O0_KEY: list[str] = []


def _o0_key() -> str:
    """The region key of an O0 rule, as ``mpjax.flax.wrap(rules={path: "O0"})`` makes it."""
    if not _O0_KEY:
        _O0_KEY.append(region_key(Policy.from_level("O0")))
    return _O0_KEY[0]


@contextlib.contextmanager
def _module_scope(path: str, keep: frozenset[str]) -> Iterator[None]:
    """Names a module's ops with its path; a path in `keep` also runs as an O0 rule would."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.named_scope(_MODULE_SCOPE + path.replace("/", "|")))
        if path in keep:  # the two scopes of an O0 rule of mpjax.flax.wrap, innermost
            stack.enter_context(marker_scope(F32_REGION))
            stack.enter_context(marker_scope(_o0_key()))
        yield


def module_of(name_stack: str) -> str | None:
    found = _MODULE_RE.findall(name_stack)
    return found[-1].replace("|", "/") if found else None


def clean_name(name_stack: str) -> str:
    """The name stack without compare's own scopes (``transpose(jvp(Net))/Dense_0``)."""
    parts = _MODULE_RE.sub("", name_stack).split("/")
    return "/".join(p for p in parts if p and not _EMPTY_CALL.fullmatch(p))


_EMPTY_CALL = re.compile(r"(\w+\()*\)*")


@contextlib.contextmanager
def linen_paths(keep: frozenset[str]) -> Iterator[None]:
    """Every linen module method call runs in its path's scope (``nn.intercept_methods``)."""
    if "flax.linen" not in sys.modules:
        yield
        return
    import flax.linen as nn

    def intercept(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        path = "/".join(str(p) for p in context.module.path)
        with _module_scope(path, keep):
            return next_fun(*args, **kwargs)

    with nn.intercept_methods(intercept):
        yield


@contextlib.contextmanager
def nnx_paths(keep: frozenset[str]) -> Iterator[None]:
    """NNX records no module path; for models wrapped by ``mpjax.flax.wrap``, each module's
    call runs in its path's scope (``mpjax.flax.module_scopes``), the paths being the ones
    ``rules=`` keys name."""
    flax_mod: Any = sys.modules.get("mpjax.flax")
    if flax_mod is None:  # no wrapped NNX model can run: NNX ops have no paths
        yield
        return
    with flax_mod.module_scopes(lambda path: _module_scope(path, keep)):
        yield
