"""Flax wrappers: run linen and NNX modules under a policy, with per-module rules.

``mpjax.flax.wrap(module, policy, rules=None)`` stores params in ``policy.param_dtype``
(BatchNorm statistics always in float32) and runs the module under :func:`mpjax.autocast`.
Rules map a module class (subclasses included) or a module path glob to a policy or a level,
e.g. ``{nn.BatchNorm: "O0", "decoder/*": "O1"}``; the innermost matching module decides, a
path rule beats a class rule for the same module, and a subclass's rule beats its base's.
With ``keep_norm_fp32`` (the default at O1/O2) every normalization layer runs in float32.
Rules also reach modules run inside linen's lifted transforms and NNX's (``nnx.scan``,
``vmap``, ``remat``, ``jit``, ``cond``, the loops), e.g. a stack of layers made with
``nnx.vmap`` and run with ``nnx.scan``; such a stack has one path (``"blocks/norm"``).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from mpjax._src import hardware, levels
from mpjax._src.float8 import fp8 as fp8_lib
from mpjax._src.float8.fp8 import FP8Policy
from mpjax._src.interpreter.autocast_api import autocast, kernels_in_half
from mpjax._src.interpreter.module_paths import glob_path
from mpjax._src.interpreter.regions import F32_REGION, marker_scope, region_key
from mpjax._src.policy import Policy, cast_floating
from mpjax._src.scaling import loss_scale as ls_lib
from mpjax._src.scaling import transform

RuleKey = type | str
Rules = Mapping[RuleKey, Policy | str]

_LINEN_NORMS: tuple[type, ...] = (nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
_NNX_NORMS: tuple[type, ...] = (nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm)
_STATS_COLLECTIONS = ("batch_stats",)


def _rule_policy(value: Policy | str, base: Policy) -> Policy:
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        half = np.dtype(base.compute_dtype) if base.half else None
        return Policy.from_level(value, half)
    raise TypeError(
        f"A rule maps to a Policy or a level string ('O0'..'O3'), got {type(value).__name__}."
    )


class _Resolver:
    """Matches modules against rules and names the region marker that applies."""

    def __init__(self, policy: Policy, rules: Rules | None, norms: tuple[type, ...]):
        if rules is not None and not isinstance(rules, Mapping):
            raise TypeError(
                f"rules must be a dict like {{nn.BatchNorm: 'O0', 'decoder/*': 'O1'}}, got "
                f"{type(rules).__name__}; for one policy everywhere, pass it as `policy`."
            )
        self.class_rules: list[tuple[type, str]] = []
        self.path_rules: list[tuple[str, str]] = []
        self.markers: dict[str, Policy] = {}
        self._by_class: dict[type, str | None] = {}
        self.keys: list[RuleKey] = list(rules or {})
        self.seen: dict[str, type] = {}  # module path -> class, of the modules seen so far
        for key, value in (rules or {}).items():
            try:
                rule_policy = _rule_policy(value, policy)
            except (TypeError, ValueError) as e:
                raise type(e)(f"rules[{_key_name(key)}]: {e}") from None
            marker = region_key(rule_policy)
            self.markers[marker] = rule_policy
            if isinstance(key, type):
                self.class_rules.append((key, marker))
            elif isinstance(key, str):
                self.path_rules.append((key, marker))
            else:
                raise TypeError(
                    f"Rule keys are module classes or path globs like 'decoder/*', got {key!r}."
                )
        if policy.keep_norm_fp32 and policy.half:
            covered = [cls for cls, _ in self.class_rules]
            for norm in norms:
                if not any(issubclass(norm, c) for c in covered):
                    self.class_rules.append((norm, F32_REGION))

    def check_keys(self, model: str) -> None:
        """Raises ValueError naming each rule key that matches none of the modules seen."""
        problems = [self._unmatched(k) for k in self.keys if not self._matches(k)]
        if problems:
            raise ValueError(
                f"rules for {model}: {'; '.join(problems)}. A rule that matches nothing would "
                "leave those layers in the base policy without a word, so mpjax refuses it. "
                "Path keys are '/'-joined module names as Flax names them ('Dense_0', "
                "'encoder/*'); class keys match instances and subclasses."
            )

    def _matches(self, key: RuleKey) -> bool:
        if isinstance(key, type):
            return any(issubclass(c, key) for c in self.seen.values())
        return any(glob_path(p, key) for p in self.seen)

    def _unmatched(self, key: RuleKey) -> str:
        import difflib  # only on the error path

        if isinstance(key, type):
            classes = sorted({c.__name__ for c in self.seen.values()})
            return (
                f"class key {key.__name__} matches no module (the classes are {', '.join(classes)})"
            )
        paths = sorted(p for p in self.seen if p)
        names = {c.__name__ for c in self.seen.values()}
        if not paths:
            top = next(iter(names), "the module")
            return (
                f"path key {key!r} matches no module path: {top} has no submodules, so no path "
                f"key can match; to rule the module itself, use its class, {{{top}: ...}}, or "
                "wrap it with that policy"
            )
        lower = {p.lower(): p for p in paths}
        close = [lower[m] for m in difflib.get_close_matches(key.lower(), list(lower), n=3)]
        hint = f"; closest paths: {', '.join(map(repr, close))}" if close else ""
        if key in names:
            hint += f"; {key!r} is a class name: use the class itself, {{{key}: ...}}"
        shown = ", ".join(map(repr, paths[:12])) + (", ..." if len(paths) > 12 else "")
        return f"path key {key!r} matches no module path (the paths are {shown}){hint}"

    def marker(self, module: Any, path: str) -> str | None:
        marker = self.path_marker(path)
        return marker if marker is not None else self.class_marker(type(module))

    @contextlib.contextmanager
    def region(self, marker: str) -> Iterator[None]:
        """The named scope of a rule's region. A float32 rule also opens the float32 region
        around it: an enclosing interpreter that does not know this wrapper's rules (the one
        of ``mpjax.fp8.scaled_value_and_grad``) then keeps the region in float32 too, out of FP8."""
        rule = self.markers.get(marker)
        outer = rule is not None and not levels.casts(rule)
        with contextlib.ExitStack() as stack:
            if outer:
                stack.enter_context(marker_scope(F32_REGION))
            stack.enter_context(marker_scope(marker))
            yield

    def path_marker(self, path: str) -> str | None:
        for pattern, marker in self.path_rules:
            if glob_path(path, pattern):
                return marker
        return None

    def class_marker(self, cls: type) -> str | None:
        if cls not in self._by_class:
            # The most specific class wins: a rule for a subclass beats one for its base.
            mro = cls.__mro__
            matches = [(mro.index(c), marker) for c, marker in self.class_rules if c in mro]
            self._by_class[cls] = min(matches)[1] if matches else None
        return self._by_class[cls]


def _key_name(key: Any) -> str:
    return key.__name__ if isinstance(key, type) else repr(key)


def _cast_variables(variables: Any, policy: Policy) -> Any:
    out = {}
    for name, collection in dict(variables).items():
        if name == "params":
            out[name] = cast_floating(collection, policy.param_dtype)
        elif name in _STATS_COLLECTIONS:
            out[name] = cast_floating(collection, np.float32)
        else:
            out[name] = collection
    return out


class LinenWrapped:
    """A linen module run under a policy; made by :func:`wrap`. Has linen's init and apply.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, mpjax, mpjax.flax
      >>> model = mpjax.flax.wrap(nn.Dense(2), mpjax.Policy.from_level("O2", "bfloat16"))
      >>> v = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> type(model).__name__, model.apply(v, jnp.ones((1, 3))).dtype
      ('LinenWrapped', dtype('float32'))"""

    def __init__(self, module: nn.Module, policy: Policy, rules: Rules | None = None):
        self.module = module
        self.policy = policy
        self._fp8: FP8Policy | None = None  # the FP8 policy wrap was given (see wrap)
        self._resolver = _Resolver(policy, rules, _LINEN_NORMS)
        # One autocast per (method, mutable), kept across calls: autocast caches its trace
        # per signature, so a retrace (a new jit of the step) or an eager call with shapes
        # seen before replays it instead of tracing the module twice again.
        self._traced: collections.OrderedDict[Any, Callable[..., Any]] = collections.OrderedDict()

    def __repr__(self) -> str:
        return f"mpjax.flax.wrap({type(self.module).__name__}, {self.policy})"

    def _intercept(self, next_fun: Callable, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        path = "/".join(str(p) for p in module.path)
        self._resolver.seen.setdefault(path, type(module))
        marker = self._resolver.marker(module, path)
        if marker is None:
            return next_fun(*args, **kwargs)
        with self._resolver.region(marker):
            return next_fun(*args, **kwargs)

    def _check_rules(self, method: Any) -> None:
        # Against the modules a full call ran (another method may use only some of them).
        if method is None and self._resolver.seen:
            self._resolver.check_keys(type(self.module).__name__)

    def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> dict[str, Any]:
        """Like ``module.init``; params come back in ``policy.param_dtype``, stats in float32.

        Raises:
          ValueError: if a key of ``rules`` matches none of the modules the call ran.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, mpjax, mpjax.flax
          >>> policy = mpjax.Policy.from_level("O3", "bfloat16")
          >>> model = mpjax.flax.wrap(nn.BatchNorm(use_running_average=True), policy)
          >>> v = model.init(jax.random.key(0), jnp.ones((2, 3)))
          >>> v["params"]["scale"].dtype, v["batch_stats"]["mean"].dtype
          (dtype(bfloat16), dtype('float32'))
        """
        # The float32 forward pass init runs calls fused kernels (cuDNN attention) in half,
        # as the wrapped apply does: cuDNN refuses float32 operands.
        kernels = kernels_in_half(self.policy, self._resolver.markers)
        with nn.intercept_methods(self._intercept), kernels:
            variables = self.module.init(rngs, *args, method=method, **kwargs)
        self._check_rules(method)
        return _cast_variables(variables, self.policy)

    def apply(
        self,
        variables: Any,
        *args: Any,
        rngs: Any = None,
        method: Any = None,
        mutable: Any = False,
        **kwargs: Any,
    ) -> Any:
        """Like ``module.apply``, run under the policy; outputs in ``policy.output_dtype``.

        Mutable collections come back in their stored dtypes (``batch_stats`` in float32).

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn, mpjax, mpjax.flax
          >>> policy = mpjax.Policy.from_level("O3", "bfloat16")
          >>> model = mpjax.flax.wrap(nn.BatchNorm(use_running_average=False), policy)
          >>> v = model.init(jax.random.key(0), jnp.ones((2, 3)))
          >>> y, updates = model.apply(v, jnp.ones((2, 3)), mutable=["batch_stats"])
          >>> y.dtype, updates["batch_stats"]["mean"].dtype   # stats stay float32
          (dtype(bfloat16), dtype('float32'))
        """

        if self._fp8 is not None:
            fp8_lib.warn_outside(type(self.module).__name__, self._fp8, stacklevel=2)
        out = self._autocast(method, mutable)(variables, rngs, args, kwargs)
        self._check_rules(method)
        if mutable is False:
            return self.policy.cast_to_output(out)
        out, state = out
        # New params and stats are stored per policy (init with mutable=True).
        new = _cast_variables({k: v for k, v in state.items() if k not in variables}, self.policy)
        state = {k: new.get(k, v) for k, v in state.items()}
        return self.policy.cast_to_output(out), state

    def _autocast(self, method: Any, mutable: Any) -> Callable[..., Any]:
        """The kept autocast of this (method, mutable), made on the first call."""
        key = (method, tuple(mutable) if isinstance(mutable, list) else mutable)
        try:
            fn = self._traced.get(key)
        except TypeError:  # an unhashable method or mutable: trace afresh, as jit would
            return self._new_autocast(method, mutable)
        if fn is None:
            fn = self._traced[key] = self._new_autocast(method, mutable)
            if len(self._traced) > _TRACED_SIZE:
                self._traced.popitem(last=False)
        self._traced.move_to_end(key)
        return fn

    def _new_autocast(self, method: Any, mutable: Any) -> Callable[..., Any]:
        def run(variables: Any, rngs: Any, args: Any, kwargs: Any) -> Any:
            with nn.intercept_methods(self._intercept):
                return self.module.apply(
                    variables, *args, rngs=rngs, method=method, mutable=mutable, **kwargs
                )

        return autocast(
            run,
            self.policy,
            rules=self._resolver.markers,
            cast_outputs=False if mutable is False else _state_as_without_mpjax,
        )


# How many (method, mutable) pairs a linen wrapper keeps traced.
_TRACED_SIZE = 16


class NNXWrapped(nnx.Module):
    """An NNX module run under a policy; made by :func:`wrap`. Call it like the module.

    Example:
      >>> import jax.numpy as jnp, mpjax, mpjax.flax
      >>> from flax import nnx
      >>> model = mpjax.flax.wrap(nnx.Linear(3, 2, rngs=nnx.Rngs(0)),
      ...                         mpjax.Policy.from_level("O3", "bfloat16"))
      >>> model.inner.kernel[...].dtype, model(jnp.ones((1, 3))).dtype
      (dtype(bfloat16), dtype(bfloat16))"""

    def __init__(self, module: nnx.Module, policy: Policy, rules: Rules | None = None):
        params = nnx.state(module, nnx.Param)
        nnx.update(module, cast_floating(params, policy.param_dtype))
        stats = nnx.state(module, nnx.BatchStat)
        nnx.update(module, cast_floating(stats, np.float32))
        self.inner = module
        self.policy = policy
        self._fp8: FP8Policy | None = None  # the FP8 policy wrap was given (see wrap)
        self._resolver = _Resolver(policy, rules, _NNX_NORMS)
        self._traced = autocast(
            functools.partial(_nnx_run, self._resolver),
            policy,
            rules=self._resolver.markers,
            cast_outputs=_state_as_without_mpjax,
        )
        for path, sub in _iter_modules(module):
            self._resolver.seen.setdefault("/".join(str(p) for p in path), type(sub))
        self._resolver.check_keys(type(module).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The state goes through autocast as NNX's flat state (path, Variable) and comes back
        # the same way: a State's nested mapping can mix int and str keys (nnx.List, sown
        # intermediates under nnx.capture), which a jax.tree_util walk cannot sort, and the
        # call may create, replace or remove Variables, so the state after it is read from
        # the model, not mapped against the state before it. The paths after the call ride
        # in the output's tree structure, so autocast's trace of a graphdef is reused by
        # later calls (a retrace, an eager call) with the same graphdef and shapes.
        if self._fp8 is not None:
            fp8_lib.warn_outside(type(self.inner).__name__, self._fp8, stacklevel=2)
        graphdef, paths, variables = _flatten(self.inner)
        out, after, new_variables = self._traced(graphdef, variables, args, kwargs)
        removed = set(paths) - set(after.paths)
        nnx.update(self.inner, _from_flat_state(list(zip(after.paths, new_variables))))
        for path in sorted(removed, key=len, reverse=True):
            _remove(self.inner, path)
        return self.policy.cast_to_output(out)


# nnx.from_flat_state where Flax has it (State.from_flat_path warns that it is deprecated).
_from_flat_state = getattr(nnx, "from_flat_state", None) or nnx.State.from_flat_path


class _Paths:
    """Variable paths, carried in a pytree's structure (no leaves)."""

    def __init__(self, paths: tuple[tuple[Any, ...], ...]):
        self.paths = paths


jax.tree_util.register_pytree_node(_Paths, lambda p: ((), p.paths), lambda aux, _: _Paths(aux))


def _nnx_run(resolver: _Resolver, graphdef: Any, variables: Any, args: Any, kwargs: Any) -> Any:
    model = nnx.graph.unflatten(graphdef, list(variables))
    with contextlib.ExitStack() as stack:
        # Each module's ops are named by its path, as linen names them (``Net/fc``, a list's
        # ``blocks_0``): the audit's and jax.profiler's rows then say which layer they are.
        stack.enter_context(_path_scopes(model, functools.partial(_named, type(model).__name__)))
        for scope in _MODULE_SCOPES.get():  # see module_scopes
            stack.enter_context(_path_scopes(model, scope))
        stack.enter_context(_nnx_markers(model, resolver))
        out = model(*args, **kwargs)
    _, new_paths, new_variables = _flatten(model)
    return out, _Paths(tuple(new_paths)), new_variables


def _named(root: str, path: str) -> Any:
    """The name scope of the module at `path` (its parent's scope is entered already)."""
    parts = path.split("/") if path else []
    if not parts:
        return jax.named_scope(root)
    name = parts[-1]
    if name.isdigit() and len(parts) > 1:  # an nnx.List item: linen's "layers_0"
        name = f"{parts[-2]}_{name}"
    return jax.named_scope(name)


def _state_as_without_mpjax(out_tree: Any) -> list[bool]:
    """For a call's (output, state) tree (NNX: output, paths, state): the state's leaves
    (Variables kept, made or replaced by the call; a linen call's collections) come back in
    the dtype the model itself gives them, whatever changed shape or structure during the
    call; the output as computed."""
    output = out_tree.children()[0].num_leaves
    return [False] * output + [True] * (out_tree.num_leaves - output)


def _flatten(node: Any) -> tuple[Any, list[tuple[Any, ...]], list[Any]]:
    """NNX's graph flattening: the graphdef, each Variable's path and the Variables, in the
    order NNX walks the graph (never sorted: the keys of one node can mix ints and strs)."""
    graphdef, flat = nnx.graph.flatten(node)
    pairs = list(flat)
    return graphdef, [tuple(p) for p, _ in pairs], [v for _, v in pairs]


def _remove(root: Any, path: tuple[Any, ...]) -> None:
    """Removes the Variable at `path` of `root`, as the call removed it (e.g. ``nnx.pop``)."""

    def is_item(node: Any, key: Any) -> bool:  # an nnx.List or nnx.Dict entry, not an attribute
        return isinstance(key, int) or not hasattr(node, str(key))

    node = root
    for key in path[:-1]:
        node = node[key] if is_item(node, key) else getattr(node, key)
    if is_item(node, path[-1]):
        del node[path[-1]]
    else:
        delattr(node, path[-1])


def _iter_modules(model: nnx.Module) -> Iterator[tuple[tuple[Any, ...], nnx.Module]]:
    """(path, module) for `model` and every NNX module inside it."""
    if hasattr(nnx, "iter_modules"):
        return nnx.iter_modules(model)
    # Flax 0.11.0 has only the method, which later Flax deprecates for nnx.iter_modules.
    return model.iter_modules()


# A path rule's marker, stored on the NNX module itself: a plain string attribute is static,
# so it lives in the graphdef and survives nnx.split/merge, which is how nnx.scan, vmap,
# remat, jit, cond and the loops hand a module to their body (as a new object).
_MARKER_ATTR = "_mpjax_marker"


def _holds_marks(module: nnx.Module) -> bool:
    # ToNNX reads each of its attributes as a linen variable collection: no extra ones there.
    return not isinstance(module, nnx.bridge.ToNNX)


def _find_call(cls: type) -> Any:
    """The ``__call__`` instances of `cls` run, or None (not the metaclass's, which builds)."""
    return next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)


@contextlib.contextmanager
def _patched_calls(classes: Iterable[type], scope_for: Callable[[Any], Any]) -> Iterator[None]:
    """For the duration, each class's ``__call__`` runs inside ``scope_for(module)``, a context
    manager, or as it is where that gives None."""
    originals: dict[type, Any] = {}
    for cls in classes:
        call = _find_call(cls)
        if call is None:
            continue  # not callable (a container); its submodules are patched on their own
        originals[cls] = cls.__dict__.get("__call__")

        @functools.wraps(call)
        def patched(self: Any, *a: Any, __call: Any = call, **k: Any) -> Any:
            scope = scope_for(self)
            if scope is None:
                return __call(self, *a, **k)
            with scope:
                return __call(self, *a, **k)

        cls.__call__ = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.__call__
            else:
                cls.__call__ = original  # type: ignore[method-assign]


# Scopes entered around each module call of a wrapped NNX model, by path (see module_scopes).
_MODULE_SCOPES: contextvars.ContextVar[tuple[Callable[[str], Any], ...]] = contextvars.ContextVar(
    "mpjax_module_scopes", default=()
)
# A module's path for module_scopes, stored on it as _MARKER_ATTR is (it survives NNX's
# split/merge).
_PATH_ATTR = "_mpjax_scope_path"


@contextlib.contextmanager
def module_scopes(
    scope: Callable[[str], contextlib.AbstractContextManager[Any]],
) -> Iterator[None]:
    """While active, each module call of an NNX model that :func:`wrap` runs is made inside
    ``scope(path)``, `path` being the module's path in the model (``"blocks/attn"``, ``""``
    for the model itself), also inside NNX's transforms. This is what linen's
    ``nn.intercept_methods`` offers for linen modules; ``mpjax.compare`` names each module's
    ops by its path this way. Scopes nest: the innermost ``module_scopes`` is entered last.

    Example:
      >>> import contextlib, jax.numpy as jnp, mpjax, mpjax.flax
      >>> from flax import nnx
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.fc = nnx.Linear(2, 2, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.fc(x)
      >>> model = mpjax.flax.wrap(Net(nnx.Rngs(0)), mpjax.Policy.from_level("O0"))
      >>> seen = []
      >>> @contextlib.contextmanager
      ... def scope(path):
      ...     seen.append(path)
      ...     yield
      >>> with mpjax.flax.module_scopes(scope):
      ...     _ = model(jnp.ones((1, 2)))
      >>> seen
      ['', 'fc']
    """
    token = _MODULE_SCOPES.set((*_MODULE_SCOPES.get(), scope))
    try:
        yield
    finally:
        _MODULE_SCOPES.reset(token)


@contextlib.contextmanager
def _path_scopes(model: nnx.Module, scope: Callable[[str], Any]) -> Iterator[None]:
    # As _nnx_markers: a string attribute is static, so it survives the split/merge of NNX
    # transforms; the classes' __call__ are patched for the duration of the trace.
    by_id: dict[int, str] = {}
    classes: set[type] = set()
    for path, sub in _iter_modules(model):
        p = "/".join(str(x) for x in path)
        if _holds_marks(sub):
            setattr(sub, _PATH_ATTR, p)
        else:
            by_id[id(sub)] = p
        classes.add(type(sub))

    def scope_for(module: Any) -> Any:
        path = getattr(module, _PATH_ATTR, None)
        path = by_id.get(id(module)) if path is None else path
        return None if path is None else scope(path)

    with _patched_calls(classes, scope_for):
        yield


@contextlib.contextmanager
def _nnx_markers(model: nnx.Module, resolver: _Resolver) -> Iterator[None]:
    # NNX modules are plain objects called through their class's __call__, so the classes are
    # patched for the duration of the trace. The patched __call__ decides from what survives
    # the graphdef split/merge of NNX transforms: the module's class (class rules, norms) or
    # its path mark (path rules). Identity does not survive (it is kept only for modules
    # that cannot hold a mark, and only works outside transforms).
    by_id: dict[int, str] = {}
    classes = {cls for cls, _ in resolver.class_rules}
    for path, sub in _iter_modules(model):
        marker = resolver.path_marker("/".join(str(p) for p in path))
        if marker is not None:
            classes.add(type(sub))
            if _holds_marks(sub):
                setattr(sub, _MARKER_ATTR, marker)
            else:
                by_id[id(sub)] = marker
            continue
        if _MARKER_ATTR in vars(sub):
            delattr(sub, _MARKER_ATTR)  # an enclosing wrapper's mark means nothing here
        if resolver.class_marker(type(sub)) is not None:
            classes.add(type(sub))  # it may override __call__ of the class the rule names

    def region(module: Any) -> str | None:
        marker = getattr(module, _MARKER_ATTR, None) or by_id.get(id(module))
        return marker if marker is not None else resolver.class_marker(type(module))

    def scope_for(module: Any) -> Any:
        marker = region(module)
        return None if marker is None else resolver.region(marker)

    with _patched_calls(classes, scope_for):
        yield


def wrap(module: Any, policy: Policy | FP8Policy, rules: Rules | None = None) -> Any:
    """Wraps a Flax linen or NNX module to run under `policy`.

    With an FP8 policy (``mpjax.fp8.policy("O2")``) the module runs under its base policy,
    rules included; its eligible dots run in FP8 where the loss that calls it goes through
    ``mpjax.fp8.scaled_value_and_grad`` (or ``mpjax.fp8.apply``), and in the base half dtype
    elsewhere. Regions that a rule keeps in float32 (``"O0"``, and norms with
    ``keep_norm_fp32``) stay out of FP8.

    Args:
      module: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
      policy: the precision policy, e.g. ``mpjax.Policy.from_level("O2")``, or an
        ``mpjax.fp8.FP8Policy``.
      rules: per-module policies: keys are module classes (subclasses included) or path globs
        (``"decoder/*"``, ``"*/attention"``), values are a Policy or a level string. The
        innermost matching module decides; a path rule beats a class rule. Rules reach
        modules inside linen and NNX transforms; layers stacked with ``nnx.vmap`` share one
        path (``"blocks/norm"``, not ``"blocks/0/norm"``).

    Returns:
      For linen, an object with linen's ``init`` and ``apply`` (usable as a TrainState's
      ``apply_fn``). For NNX, an ``nnx.Module`` holding the module as ``.inner``, usable with
      ``nnx.Optimizer``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, mpjax, mpjax.flax
      >>> model = mpjax.flax.wrap(nn.Dense(4), mpjax.Policy.from_level("O3", "bfloat16"))
      >>> variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> variables["params"]["kernel"].dtype, model.apply(variables, jnp.ones((2, 3))).dtype
      (dtype(bfloat16), dtype(bfloat16))
    """
    fp8 = policy if isinstance(policy, FP8Policy) else None
    if fp8 is not None:
        policy = fp8.base  # FP8 itself: mpjax.fp8.scaled_value_and_grad around the loss
    if not isinstance(policy, Policy):
        raise TypeError(
            f"wrap needs an mpjax.Policy, got {type(policy).__name__}; e.g. "
            "mpjax.Policy.from_level('O2')."
        )
    if isinstance(module, (LinenWrapped, NNXWrapped)):
        inner = module.module if isinstance(module, LinenWrapped) else module.inner
        raise TypeError(
            f"This {type(inner).__name__} is already wrapped by mpjax.flax.wrap; wrap the bare "
            f"module once, mpjax.flax.wrap({type(inner).__name__}(...), policy), with every "
            "rule in that one call's rules=."
        )
    if isinstance(module, type) and issubclass(module, (nn.Module, nnx.Module)):
        raise TypeError(
            f"wrap takes a module instance, got the class {module.__name__}; pass "
            f"{module.__name__}(...) (for NNX with its rngs), e.g. "
            f"mpjax.flax.wrap({module.__name__}(), policy)."
        )
    hardware.warn_if_slow(policy)  # here, so the warning points at the caller's wrap()
    if isinstance(module, nn.Module):
        wrapped: LinenWrapped | NNXWrapped = LinenWrapped(module, policy, rules)
    elif isinstance(module, nnx.Module):
        wrapped = NNXWrapped(module, policy, rules)
    else:
        raise TypeError(
            f"wrap takes a flax.linen.Module or a flax.nnx.Module, got {type(module).__name__}; "
            "for a plain function use mpjax.autocast(fn, policy)."
        )
    wrapped._fp8 = fp8
    return wrapped


class TrainState(train_state.TrainState):
    """A linen ``TrainState`` that does the loss scaling itself.

    ``create(..., policy=policy)`` wraps ``tx`` as ``mpjax.loss_scale(tx,
    scale=policy.loss_scale())``. :meth:`grad` scales the loss and differentiates;
    ``apply_gradients`` (inherited) then unscales, checks, skips and adjusts the scale.

    Example:
      >>> import jax, jax.numpy as jnp, optax, flax.linen as nn, mpjax, mpjax.flax
      >>> policy = mpjax.Policy.from_level("O2", "float16")
      >>> model = mpjax.flax.wrap(nn.Dense(1), policy)
      >>> x, y = jnp.ones((8, 3)), jnp.ones((8, 1))
      >>> state = mpjax.flax.TrainState.create(
      ...     apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
      ...     tx=optax.sgd(0.1), policy=policy)
      >>> def loss_fn(params):
      ...     return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
      >>> loss, grads = state.grad(loss_fn)
      >>> state = state.apply_gradients(grads=grads)
      >>> m = state.metrics()   # float16 gradients overflowed at 2**15: skipped, backed off
      >>> int(m["skipped_steps"]), float(m["loss_scale"])
      (1, 16384.0)
    """

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable,
        params: Any,
        tx: optax.GradientTransformation,
        policy: Policy | FP8Policy | str | None = None,
        scale: ls_lib.LossScale | None = None,
        **kwargs: Any,
    ) -> TrainState:
        """Creates the state; `tx` is wrapped in ``mpjax.loss_scale`` (the wrap form).

        Args:
          apply_fn: usually ``mpjax.flax.wrap(module, policy).apply``.
          params: the params (already in ``policy.param_dtype`` if from the wrapper).
          tx: the optimizer.
          policy: gives the loss scale (``policy.loss_scale()``) unless `scale` is given: a
            Policy, a level name (``"O2"``, as ``Policy.from_level`` takes it) or an FP8
            policy (its base level's scale).
          scale: the loss scale; default from `policy`, else ``DynamicLossScale(2**15)``.
          **kwargs: other TrainState fields.

        Raises:
          ValueError: if `tx` already holds an ``mpjax.loss_scale``.

        Example:
          >>> import jax.numpy as jnp, optax, mpjax, mpjax.flax
          >>> state = mpjax.flax.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
          ...     tx=optax.sgd(0.1), policy=mpjax.Policy.from_level("O1", "float16"))
          >>> type(state.opt_state).__name__, state.loss_scale.loss_scale.item()
          ('LossScaleState', 32768.0)
        """
        if isinstance(policy, str):
            policy = Policy.from_level(policy)
        if isinstance(policy, FP8Policy):
            policy = policy.base  # its loss scale is the base level's
        if scale is None and policy is not None:
            scale = policy.loss_scale()
        state = super().create(
            apply_fn=apply_fn, params=params, tx=transform.loss_scale(tx, scale=scale), **kwargs
        )
        if len(transform.find_states(state.opt_state)) > 1:
            raise ValueError(
                "TrainState.create wraps tx in mpjax.loss_scale itself, and this tx already "
                "holds one; pass the bare optimizer (e.g. tx=optax.adamw(1e-3)) and the scale "
                "as scale=... or policy=..."
            )
        return state

    @property
    def loss_scale(self) -> ls_lib.LossScale:
        """The current loss scale.

        Example:
          >>> import jax.numpy as jnp, optax, mpjax, mpjax.flax
          >>> state = mpjax.flax.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
          ...     tx=optax.sgd(0.1), policy=mpjax.Policy.from_level("O2", "bfloat16"))
          >>> type(state.loss_scale).__name__   # bfloat16 needs no scaling
          'NoOpLossScale'
        """
        return transform.get_loss_scale(self.opt_state)

    def metrics(self) -> dict[str, jax.Array]:
        """``mpjax.loss_scale_metrics`` of this state.

        Example:
          >>> import jax.numpy as jnp, optax, mpjax, mpjax.flax
          >>> state = mpjax.flax.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
          ...     tx=optax.sgd(0.1), scale=mpjax.StaticLossScale(8.0))
          >>> m = state.metrics()
          >>> m["loss_scale"].item(), m["skipped_steps"].item(), m["last_step_finite"].item()
          (8.0, 0, True)
        """
        return transform.loss_scale_metrics(self.opt_state)

    def grad(self, loss_fn: Callable, *args: Any, has_aux: bool = False) -> Any:
        """Returns ``(loss, grads)`` (``((loss, aux), grads)`` with `has_aux`) of
        ``loss_fn(params, *args)``: the loss unscaled, the gradients of the scaled loss, ready
        for ``apply_gradients``.

        Example:
          >>> import jax.numpy as jnp, optax, mpjax, mpjax.flax
          >>> state = mpjax.flax.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
          ...     tx=optax.sgd(0.1), scale=mpjax.StaticLossScale(8.0))
          >>> loss, grads = state.grad(lambda p, x: jnp.sum(p["w"] * x), jnp.full(2, 3.0))
          >>> loss.item(), grads["w"].tolist()   # the loss unscaled, the grads of 8 * loss
          (6.0, [24.0, 24.0])
        """
        return transform.scaled_value_and_grad(loss_fn, has_aux=has_aux)(
            self.opt_state, self.params, *args
        )


def _value_and_grad(fun: Callable, optimizer: Any, *, has_aux: bool = False) -> Callable:
    grad_fn = transform.scaled_value_and_grad(fun, has_aux=has_aux)
    return lambda model, *args, **kwargs: grad_fn(optimizer, model, *args, **kwargs)


# Renamed: mpjax.scaled_value_and_grad(fun)(optimizer, model, ...) is the NNX form.
value_and_grad = transform.renamed(
    "mpjax.flax.value_and_grad(fun, optimizer)(model, ...)",
    "mpjax.scaled_value_and_grad(fun)(optimizer, model, ...)",
    _value_and_grad,
)


__all__ = [
    "LinenWrapped",
    "module_scopes",
    "NNXWrapped",
    "TrainState",
    "wrap",
]
