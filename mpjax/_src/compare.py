"""Where precision is lost: `compare` runs a function's mixed-precision program op by op beside
its float32 shadow, and `find_f32_rules` searches for the few modules or op kinds to keep in
float32 so that the outputs meet a tolerance."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src import jax_compat as jc
from mpjax._src import ops
from mpjax._src.audit import _short
from mpjax._src.autocast import (
    F32_REGION,
    INLINE_CALLS,
    TRACE_SALT,
    _dynamic,
    _flax_module_kind,
    _scatter_update,
    autocast,
    flat_call,
    region_key,
)
from mpjax._src.hardware import HardwareWarning
from mpjax._src.policy import Policy
from mpjax._src.rules import _PASS_OPS, _TRACED_DTYPE_OPS, SHAPE_OPS

# Calls whose body maps its operands and results one to one: evaluated inline.
_CALLS = {
    **INLINE_CALLS,
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",  # JAX 0.6's name of custom_vjp_call
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}
# Ops that only move data: their error is their input's, so they get no row.
_MOVES = SHAPE_OPS | _PASS_OPS
# Ops whose float operands only decide something: never candidates for the float32 list.
_NOT_CANDIDATES = frozenset({"convert_element_type", "sort", "argmax", "argmin", "top_k"}) | _MOVES

# Module paths travel in the name stack as this scope (``/`` would split it into parts).
_MODULE_SCOPE = "mpjax_module:"
_MODULE_RE = re.compile(re.escape(_MODULE_SCOPE) + r"([^/()]*)")

METRICS = ("rms", "max")


# -- the error metric --------------------------------------------------------------------------


# An output leaf whose float32 scale is below this share of all outputs' scale is zero up to
# float32 rounding: zero in exact arithmetic (the gradient of an attention key's bias, which
# softmax ignores). Its error is measured against all outputs' scale instead of its own noise.
NOISE_SHARE = 2.0**-14


def _error(
    half: Any, ref: Any, metric: str | Callable[..., Any] = "rms", scale: float = 0.0
) -> float:
    """The error of `half` against the float32 reference `ref` (both arrays), as a float.

    "rms": ``||half - ref||_2 / ||ref||_2`` (the normwise relative error), "max":
    ``max|half - ref| / max|ref|``. Both are relative to the reference's scale, not to each
    element, so zeros in the reference do not blow them up. Positions where both are the same
    infinity or both NaN agree; an inf or NaN on one side only is an error of inf. A reference
    below NOISE_SHARE of `scale` (all outputs' RMS or max) is measured against `scale`; an
    all-zero reference with no scale gives the absolute error (the RMS or max of `half`).
    """
    h = np.asarray(half, np.float64)
    r = np.asarray(ref, np.float64)
    if callable(metric):
        return float(metric(h, r))
    with np.errstate(all="ignore"):
        same = (h == r) | (np.isnan(h) & np.isnan(r))
        if np.any(~same & ~(np.isfinite(h) & np.isfinite(r))):
            return math.inf
        d = np.where(same, 0.0, h - r)
        r = np.where(np.isfinite(r), r, 0.0)
        if h.size == 0:
            return 0.0
        if metric == "max":
            num, den = float(np.max(np.abs(d))), float(np.max(np.abs(r)))
        else:
            num, den = float(np.sqrt(np.mean(d * d))), float(np.sqrt(np.mean(r * r)))
    if den < NOISE_SHARE * scale:
        den = scale
    return num / den if den > 0 else num


def _output_scale(refs: list[Any], metric: Any) -> float:
    """The scale (RMS, or max for "max") of all the float32 outputs' finite values; 0 for a
    metric of the user's own."""
    if callable(metric):
        return 0.0
    with np.errstate(all="ignore"):
        values = [np.asarray(r, np.float64).ravel() for r in refs]
        values = [v[np.isfinite(v)] for v in values]
        n = sum(v.size for v in values)
        if n == 0:
            return 0.0
        if metric == "max":
            scale = max(float(np.max(np.abs(v))) for v in values if v.size)
        else:
            scale = math.sqrt(sum(float(np.sum(v * v)) for v in values) / n)
    return scale


def _check_metric(metric: Any) -> str | Callable[..., Any]:
    if callable(metric) or metric in METRICS:
        return metric
    raise ValueError(
        f"metric must be one of {METRICS} or a function (half, ref) -> float of two float64 "
        f"NumPy arrays, got {metric!r}; 'rms' is ||half - f32|| / ||f32||."
    )


def _metric_name(metric: Any) -> str:
    return metric if isinstance(metric, str) else getattr(metric, "__name__", "custom")


# -- results -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompareRow:
    """One equation of the mixed-precision program, against its float32 shadow.

    Attributes:
      index: the order in which the equation first ran.
      primitive: the JAX primitive (``sin``, ``dot_general``, ``convert_element_type``, ...).
      module: the Flax module path that ran it, spelled as ``rules=`` keys are (``"enc/Dense_0"``;
        ``""`` is the root module), or None outside any module.
      name: the equation's full name stack.
      source: ``file:line (function)`` of the code that made it.
      dtype: what it ran in: ``"float16"``, or ``"float32->float16"`` for a cast.
      shape: the shape of its (first floating) result.
      local_error: its result in its own dtypes, computed from the float32 program's inputs
        (rounded to those dtypes), against its float32 result from the same inputs: the
        error this op introduces.
      error: its result in the mixed program against the float32 program's: the error
        accumulated up to here.
      runs: how many times it ran (iterations of a loop body); the errors are the largest.
      backward: whether it belongs to a backward pass (a transposed equation).
      nonfinite: ``"inf"`` or ``"nan"`` if this op made one from finite inputs.
      flops: matmul/convolution FLOPs of one run (0 for other ops).
    """

    index: int
    primitive: str
    module: str | None
    name: str
    source: str | None
    dtype: str
    shape: tuple[int, ...]
    local_error: float
    error: float
    runs: int
    backward: bool
    nonfinite: str | None
    flops: int

    def where(self) -> str:
        """``module (file.py:12)``, or the source line alone outside modules."""
        line = _short(self.source) if self.source else "<autocast>"
        return line if self.module is None else f"{self.module or '<root>'} ({line})"

    def __str__(self) -> str:
        made = f", {self.nonfinite} made here" if self.nonfinite else ""
        return (
            f"{self.primitive}{' (bwd)' if self.backward else ''} -> {self.dtype}"
            f"{list(self.shape)} at {self.where()}: local error {_fmt(self.local_error)}, "
            f"error {_fmt(self.error)}{made}"
        )


@dataclasses.dataclass(frozen=True)
class ModuleError:
    """The equations of one module path, together: the largest local and accumulated errors.

    Attributes:
      module: the module path (``rules=`` key; ``""`` is the root module).
      local_error: the largest local error of its ops.
      error: the largest accumulated error of its ops.
      ops: how many of its equations have rows.
      top: the primitive with the largest local error, and where it runs.
    """

    module: str
    local_error: float
    error: float
    ops: int
    top: str


@dataclasses.dataclass(frozen=True)
class OutputError:
    """One floating output leaf (a gradient leaf under ``jax.grad``) against float32.

    Attributes:
      path: the leaf's path in the output (``jax.tree_util.keystr``), ``""`` for a lone array.
      dtype: its dtype in the mixed program.
      shape: its shape.
      error: its error against the float32 program.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    error: float


@dataclasses.dataclass(frozen=True)
class CompareReport:
    """A mixed-precision program against float32, op by op. ``str(report)`` is a table.

    Attributes:
      rows: every equation with a floating result (data movement aside), ranked by local
        error, largest first: where the error is introduced. Loop bodies give one row per
        body equation.
      modules: per Flax module path, ranked by the largest local error of its ops.
      outputs: each floating output leaf's error, in output order.
      first_nonfinite: the first op that made an inf or NaN from finite inputs, or None.
      policy: the policy compared, as text.
      metric: the error metric ("rms": ``||half - f32|| / ||f32||``; "max": the same with max
        norms).
      notes: where the comparison is coarser: higher-order primitives compared whole, or
        loops and conditionals whose trip count or branch differed from float32.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> policy = mpjax.Policy.from_level("O2", "float16")
      >>> report = mpjax.compare(lambda x: jnp.sin(256.0 * x), policy, jnp.linspace(0, 1, 64))
      >>> report.rows[0].primitive, report.error > 0.01
      ('sin', True)
      >>> print(report.rows[0])  # doctest: +ELLIPSIS
      sin -> float16[64] at <doctest ...>:1...: local error ..., error ...
    """

    rows: tuple[CompareRow, ...]
    modules: tuple[ModuleError, ...]
    outputs: tuple[OutputError, ...]
    first_nonfinite: CompareRow | None
    policy: str
    metric: str
    notes: tuple[str, ...] = ()

    @property
    def error(self) -> float:
        """The largest output error (0.0 with no floating outputs).

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> report = mpjax.compare(jnp.sin, mpjax.Policy.from_level("O2", "float16"),
          ...                        jnp.linspace(0.0, 100.0, 64))
          >>> report.error > 1e-3
          True
        """
        return max((o.error for o in self.outputs), default=0.0)

    def records(self) -> list[dict[str, Any]]:
        """The rows as a list of plain dicts (``pandas.DataFrame(report.records())``).

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> report = mpjax.compare(jnp.sin, mpjax.Policy.from_level("O2", "float16"),
          ...                        jnp.linspace(0.0, 100.0, 64))
          >>> row = report.records()[0]; row["primitive"], row["dtype"]
          ('sin', 'float16')
        """
        return [dataclasses.asdict(r) for r in self.rows]

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the report, for tests, CI and JSON.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> report = mpjax.compare(jnp.sin, mpjax.Policy.from_level("O2", "float16"),
          ...                        jnp.linspace(0.0, 100.0, 64))
          >>> import json; sorted(json.loads(json.dumps(report.to_dict())))
          ['error', 'first_nonfinite', 'metric', 'modules', 'notes', 'outputs', 'policy', 'rows']
        """
        return {
            "policy": self.policy,
            "metric": self.metric,
            "error": self.error,
            "outputs": [dataclasses.asdict(o) for o in self.outputs],
            "modules": [dataclasses.asdict(m) for m in self.modules],
            "rows": self.records(),
            "first_nonfinite": None
            if self.first_nonfinite is None
            else dataclasses.asdict(self.first_nonfinite),
            "notes": list(self.notes),
        }

    def table(self, top: int = 15) -> str:
        """The report as text, with the `top` rows of largest local error.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> report = mpjax.compare(jnp.sin, mpjax.Policy.from_level("O2", "float16"),
          ...                        jnp.linspace(0.0, 100.0, 64))
          >>> print(report.table(top=1).splitlines()[0])
          mpjax compare: ...
        """
        lines = [
            f"mpjax compare: {self.policy} against float32, {len(self.rows)} ops, metric "
            f"{self.metric}{_METRIC_TEXT.get(self.metric, '')}",
            "",
            "| output | dtype | shape | error |",
            "|---|---|---|---:|",
        ]
        lines += [
            f"| {o.path or '<output>'} | {o.dtype} | {list(o.shape)} | {_fmt(o.error)} |"
            for o in self.outputs
        ]
        if self.modules:
            lines += [
                "",
                "| module | local error | error | ops | worst op |",
                "|---|---:|---:|---:|---|",
            ]
            lines += [
                f"| {m.module or '<root>'} | {_fmt(m.local_error)} | {_fmt(m.error)} | {m.ops} "
                f"| {m.top} |"
                for m in self.modules
            ]
        lines += [
            "",
            f"ops by local error (top {min(top, len(self.rows))} of {len(self.rows)}):",
            "| # | op | ran in | shape | local error | error | runs | where |",
            "|---:|---|---|---|---:|---:|---:|---|",
        ]
        for r in self.rows[:top]:
            op = f"{r.primitive} (bwd)" if r.backward else r.primitive
            lines.append(
                f"| {r.index} | {op} | {r.dtype} | {list(r.shape)} | {_fmt(r.local_error)} | "
                f"{_fmt(r.error)} | {r.runs} | {r.where()} |"
            )
        if self.first_nonfinite is not None:
            r = self.first_nonfinite
            lines += [
                "",
                f"first {r.nonfinite}: op {r.index} {r.primitive} -> {r.dtype}{list(r.shape)} at "
                f"{r.where()}",
            ]
        if self.notes:
            lines += ["", *[f"note: {n}" for n in self.notes]]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


_METRIC_TEXT = {"rms": " (||half - f32|| / ||f32||)", "max": " (max|half - f32| / max|f32|)"}


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else ("0" if x == 0 else f"{x:.2e}")


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
            stack.enter_context(jax.named_scope(f"mpjax:{F32_REGION}"))
            stack.enter_context(jax.named_scope(f"mpjax:{_o0_key()}"))
        yield


def _module_of(name_stack: str) -> str | None:
    found = _MODULE_RE.findall(name_stack)
    return found[-1].replace("|", "/") if found else None


def _clean_name(name_stack: str) -> str:
    """The name stack without compare's own scopes (``transpose(jvp(Net))/Dense_0``)."""
    parts = _MODULE_RE.sub("", name_stack).split("/")
    return "/".join(p for p in parts if p and not _EMPTY_CALL.fullmatch(p))


_EMPTY_CALL = re.compile(r"(\w+\()*\)*")


@contextlib.contextmanager
def _linen_paths(keep: frozenset[str]) -> Iterator[None]:
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
def _nnx_paths(keep: frozenset[str]) -> Iterator[None]:
    """NNX records no module path; for models wrapped by ``mpjax.flax.wrap``, each module's
    call runs in its path's scope. The wrapper's own marking of modules (``_nnx_markers``)
    is extended for the duration: it is handed the merged model, whose paths are the ones
    ``rules=`` keys name."""
    flax_mod: Any = sys.modules.get("mpjax.flax")
    original = getattr(flax_mod, "_nnx_markers", None)
    helpers = ("_iter_modules", "_holds_marks", "_find_call")
    if original is None or not all(hasattr(flax_mod, h) for h in helpers):
        yield  # no wrapped NNX model ran (or mpjax.flax changed): NNX ops have no paths
        return

    @contextlib.contextmanager
    def markers(model: Any, resolver: Any) -> Iterator[None]:
        with _mark_nnx(flax_mod, model, keep), original(model, resolver):
            yield

    flax_mod._nnx_markers = markers
    try:
        yield
    finally:
        flax_mod._nnx_markers = original


_PATH_ATTR = "_mpjax_compare_path"


@contextlib.contextmanager
def _mark_nnx(flax_mod: Any, model: Any, keep: frozenset[str]) -> Iterator[None]:
    # As mpjax.flax._nnx_markers: a string attribute is static, so it survives the
    # split/merge of NNX transforms; the classes' __call__ are patched while tracing.
    by_id: dict[int, str] = {}
    classes: set[type] = set()
    for path, sub in flax_mod._iter_modules(model):
        p = "/".join(str(x) for x in path)
        if flax_mod._holds_marks(sub):
            setattr(sub, _PATH_ATTR, p)
        else:
            by_id[id(sub)] = p
        classes.add(type(sub))
    originals: dict[type, Any] = {}
    for cls in classes:
        call = flax_mod._find_call(cls)
        if call is None:
            continue
        originals[cls] = cls.__dict__.get("__call__")

        def marked(self: Any, *a: Any, __call: Any = call, **k: Any) -> Any:
            path = getattr(self, _PATH_ATTR, None)
            path = by_id.get(id(self)) if path is None else path
            if path is None:
                return __call(self, *a, **k)
            with _module_scope(path, keep):
                return __call(self, *a, **k)

        cls.__call__ = marked  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, orig in originals.items():
            if orig is None:
                del cls.__call__
            else:
                cls.__call__ = orig  # type: ignore[method-assign]


@dataclasses.dataclass
class _Program:
    closed: Any
    out_tree: Any
    dyn: list[Any]
    out_paths: list[str]


def _trace(
    fn: Callable[..., Any], policy: Policy | None, args: tuple[Any, ...], keep: frozenset[str]
) -> _Program:
    """The mixed-precision program of `fn` at `args`: ``autocast(fn, policy)`` (or `fn` as it
    is), with every Flax module's ops named by path and the paths in `keep` run as O0 rules."""
    from jax.experimental.xla_metadata import set_xla_metadata

    leaves, treedef = jax.tree_util.tree_flatten((args, {}))
    dynamic = _dynamic(leaves)
    dyn = [leaves[i] for i in dynamic]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HardwareWarning)  # a comparison is not a speed run
        run = fn if policy is None else autocast(fn, policy)
    flat = flat_call(run, leaves, treedef, dynamic)
    # Functions traced before (a jitted step, an autocast function) are traced again: jax.jit
    # keys its cache on XLA metadata among other things, and autocast on TRACE_SALT.
    salt = "mpjax.compare:" + hashlib.sha1(repr(sorted(keep)).encode()).hexdigest()[:12]
    token = TRACE_SALT.set(salt)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", HardwareWarning)
            with _linen_paths(keep), _nnx_paths(keep), set_xla_metadata(mpjax_compare=salt):
                closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*dyn)
    except Exception as e:
        if type(e).__name__ != "TraceContextError":
            raise
        raise TypeError(
            "fn calls an NNX module whose state it closes over, which NNX cannot update from "
            "inside a traced function; pass the state as an argument instead: graphdef, state "
            "= nnx.split(model), then compare(lambda state, x: nnx.merge(graphdef, state)(x), "
            "None, state, x)."
        ) from e
    finally:
        TRACE_SALT.reset(token)
    with_path, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    paths = [jax.tree_util.keystr(p) for p, _ in with_path]
    return _Program(closed, out_tree, dyn, paths)


# -- the shadow evaluation ---------------------------------------------------------------------


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def _up(x: Any) -> Any:
    """`x` in float32 where it is a narrower float (the shadow program's values)."""
    if _is_float(x) and np.dtype(x.dtype).itemsize < 4:
        return jnp.asarray(x, np.float32)
    return x


def _as_traced(x: Any, v: Any) -> Any:
    """`x` in the dtype the equation's operand `v` has in the mixed program."""
    if isinstance(v, jc.Literal):
        return v.val
    dtype = v.aval.dtype
    if _is_float(x) and jnp.issubdtype(dtype, jnp.floating) and x.dtype != dtype:
        return jnp.asarray(x, dtype)
    return x


def _listify(out: Any, eqn: Any) -> list[Any]:
    return list(out) if eqn.primitive.multiple_results else [out]


def _f32_params(eqn: Any) -> dict[str, Any]:
    """The equation's parameters for float32 operands: a half result dtype becomes float32."""
    p = eqn.params
    new: dict[str, Any] = {}
    for k in ("new_dtype", "preferred_element_type", "dtype"):
        v = p.get(k)
        if v is not None and jnp.issubdtype(v, jnp.floating) and np.dtype(v).itemsize < 4:
            new[k] = np.dtype(np.float32)
    if p.get("update_jaxpr") is not None:
        new.update(_scatter_update(p, np.dtype(np.float32)))
    return {**p, **new} if new else p


def _eqn_flops(eqn: Any) -> int:
    """FLOPs of one dot_general or convolution (0 for other ops)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
        rhs_free = math.prod(d for i, d in enumerate(rhs) if i not in (*rc, *rb))
        return 2 * math.prod(lhs) * rhs_free
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_feature = eqn.params["dimension_numbers"].rhs_spec[0]
        return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs) // max(rhs[out_feature], 1)
    return 0


def _dtype_text(eqn: Any) -> str:
    ins = sorted({np.dtype(v.aval.dtype).name for v in eqn.invars if _is_float(v.aval)}, key=len)
    outs = [np.dtype(v.aval.dtype).name for v in eqn.outvars if _is_float(v.aval)]
    out = outs[0] if outs else "?"
    if not ins or ins == [out]:
        return out
    return f"{'/'.join(ins)}->{out}"


def _nonfinite_kind(x: np.ndarray) -> str | None:
    if np.isnan(x).any():
        return "nan"
    if np.isinf(x).any():
        return "inf"
    return None


@dataclasses.dataclass
class _Stat:
    index: int
    eqn: Any
    name: str
    local: float = 0.0
    error: float = 0.0
    runs: int = 0
    nonfinite: str | None = None


Pair = tuple[Any, Any]  # (value in the mixed program, value in the float32 shadow)


class _Shadow:
    """Evaluates a mixed-precision jaxpr eagerly, op by op, on two tracks: as it is (half) and
    with every float in float32 (ref, the float32 program: a cast to half is a no-op there).
    For each op with a floating result it also runs the op as the mixed program does on the
    float32 track's inputs (local). Loop bodies run iteration by iteration."""

    def __init__(self, metric: str | Callable[..., Any]):
        self.metric = metric
        self.stats: dict[tuple[Any, ...], _Stat] = {}
        self.first_nonfinite: tuple[Any, ...] | None = None
        self.notes: dict[str, None] = {}  # ordered set

    def run(
        self,
        jaxpr: Any,
        consts: list[Pair],
        args: list[Pair],
        stack: str,
        prefix: tuple[Any, ...],
        tracks: tuple[bool, bool] = (True, True),
    ) -> list[Pair]:
        env: dict[Any, Pair] = {}
        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> Pair:
            if isinstance(v, jc.Literal):
                return v.val, _up(jc.literal_array(v)) if _is_float(v.aval) else v.val
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            own = str(eqn.source_info.name_stack)
            name = f"{stack}/{own}" if stack and own else stack or own
            with eqn.ctx.manager:
                outs = self._eqn(eqn, ins, name, (*prefix, id(eqn)), tracks)
            for v, o in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jc.DropVar):
                    env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def _sub(self, closed: Any) -> tuple[Any, list[Pair]]:
        if isinstance(closed, jc.ClosedJaxpr):
            return closed.jaxpr, [(c, _up(c)) for c in closed.consts]
        return closed, []

    def _eqn(
        self, eqn: Any, ins: list[Pair], name: str, key: tuple[Any, ...], tracks: tuple[bool, bool]
    ) -> list[Pair]:
        prim = eqn.primitive.name
        if prim in _CALLS:
            jaxpr, consts = self._sub(eqn.params[_CALLS[prim]])
            return self.run(jaxpr, consts, ins, name, key, tracks)
        if prim == "scan":
            return self._scan(eqn, ins, name, key, tracks)
        if prim == "while":
            return self._while(eqn, ins, name, key, tracks)
        if prim == "cond":
            return self._cond(eqn, ins, name, key, tracks)
        hs = [h for h, _ in ins]
        rs = [r for _, r in ins]
        n = len(eqn.outvars)
        oh = _listify(jc.bind(eqn.primitive, hs, eqn.params), eqn) if tracks[0] else [None] * n
        if not tracks[1]:
            return list(zip(oh, [None] * n, strict=True))
        if eqn.effects and tracks[0]:  # a callback or print runs once
            return [(h, _up(h)) for h in oh]
        ref = self._ref(eqn, rs)
        if tracks[0] and prim not in _MOVES and any(_is_float(v.aval) for v in eqn.outvars):
            local = _listify(
                jc.bind(
                    eqn.primitive, [_as_traced(r, v) for r, v in zip(rs, eqn.invars)], eqn.params
                ),
                eqn,
            )
            self._record(eqn, key, name, hs, oh, ref, local)
        return list(zip(oh, ref, strict=True))

    def _ref(self, eqn: Any, rs: list[Any]) -> list[Any]:
        """The equation in float32 (the float32 program's op)."""
        prim = eqn.primitive.name
        if prim == "reduce_precision":
            return [rs[0]]
        higher = any(isinstance(p, (jc.Jaxpr, jc.ClosedJaxpr)) for p in eqn.params.values())
        if prim not in _TRACED_DTYPE_OPS and not (higher and "update_jaxpr" not in eqn.params):
            try:
                return [_up(o) for o in _listify(jc.bind(eqn.primitive, rs, _f32_params(eqn)), eqn)]
            except Exception:  # noqa: BLE001 - an op with no float32 form here: as the program
                pass
        self.notes[f"{prim} runs in its own dtypes in the reference, so it shows no error"] = None
        traced = [_as_traced(r, v) for r, v in zip(rs, eqn.invars, strict=True)]
        return [_up(o) for o in _listify(jc.bind(eqn.primitive, traced, eqn.params), eqn)]

    def _record(
        self,
        eqn: Any,
        key: tuple[Any, ...],
        name: str,
        hs: list[Any],
        oh: list[Any],
        ref: list[Any],
        local: list[Any],
    ) -> None:
        floats = [
            i
            for i, v in enumerate(eqn.outvars)
            if _is_float(v.aval) and not isinstance(v, jc.DropVar)
        ]
        if not floats:
            return
        stat = self.stats.get(key)
        if stat is None:
            stat = self.stats[key] = _Stat(len(self.stats), eqn, name)
        stat.runs += 1
        for i in floats:
            h = np.asarray(oh[i], np.float64)
            stat.local = max(stat.local, _error(local[i], ref[i], self.metric))
            stat.error = max(stat.error, _error(h, ref[i], self.metric))
            kind = _nonfinite_kind(h)
            if kind is not None and stat.nonfinite is None:
                made = all(np.isfinite(np.asarray(x, np.float64)).all() for x in hs if _is_float(x))
                if made:
                    stat.nonfinite = kind
                    if self.first_nonfinite is None:
                        self.first_nonfinite = key

    def _scan(
        self, eqn: Any, ins: list[Pair], name: str, key: tuple[Any, ...], tracks: tuple[bool, bool]
    ) -> list[Pair]:
        p = eqn.params
        jaxpr, consts = self._sub(p["jaxpr"])
        nc, ncarry, length = p["num_consts"], p["num_carry"], p["length"]
        fixed, carry, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
        ys: list[list[Pair]] = []
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for i in steps:
            x_i = [(None if h is None else h[i], None if r is None else r[i]) for h, r in xs]
            out = self.run(jaxpr, consts, [*fixed, *carry, *x_i], name, key, tracks)
            carry = out[:ncarry]
            ys.append(out[ncarry:])
        if p["reverse"]:
            ys.reverse()
        stacked = []
        for j, v in enumerate(eqn.outvars[ncarry:]):
            if length:
                h = jnp.stack([y[j][0] for y in ys]) if tracks[0] else None
                r = jnp.stack([y[j][1] for y in ys]) if tracks[1] else None
            else:
                h = jnp.zeros(v.aval.shape, v.aval.dtype)
                r = _up(h)
            stacked.append((h, r))
        return [*carry, *stacked]

    def _while(
        self, eqn: Any, ins: list[Pair], name: str, key: tuple[Any, ...], tracks: tuple[bool, bool]
    ) -> list[Pair]:
        p = eqn.params
        cj, cconsts = self._sub(p["cond_jaxpr"])
        bj, bconsts = self._sub(p["body_jaxpr"])
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cfixed, bfixed, carry = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
        while True:
            (go,) = self.run(cj, cconsts, [*cfixed, *carry], name, (*key, "cond"), tracks)
            on = (tracks[0] and bool(go[0]), tracks[1] and bool(go[1]))
            if not any(on):
                return carry
            if on != tracks and all(tracks):
                self.notes[
                    f"a while loop at {_short(jc.summarize_source(eqn.source_info))} ran a "
                    "different number of iterations than in float32; its body's rows cover "
                    "the iterations both ran"
                ] = None
            out = self.run(bj, bconsts, [*bfixed, *carry], name, key, on)
            carry = [
                (o[0] if on[0] else c[0], o[1] if on[1] else c[1])
                for o, c in zip(out, carry, strict=True)
            ]

    def _cond(
        self, eqn: Any, ins: list[Pair], name: str, key: tuple[Any, ...], tracks: tuple[bool, bool]
    ) -> list[Pair]:
        branches = eqn.params["branches"]
        last = len(branches) - 1
        index = [min(max(int(x), 0), last) if on else -1 for x, on in zip(ins[0], tracks)]
        if all(tracks) and index[0] == index[1]:
            jaxpr, consts = self._sub(branches[index[0]])
            return self.run(jaxpr, consts, ins[1:], name, (*key, index[0]), tracks)
        if all(tracks):
            self.notes[
                f"a cond at {_short(jc.summarize_source(eqn.source_info))} took a different "
                "branch than in float32; its branches have no rows there"
            ] = None
        outs: list[list[Any]] = [[None] * len(eqn.outvars), [None] * len(eqn.outvars)]
        for t in (0, 1):
            if tracks[t]:
                jaxpr, consts = self._sub(branches[index[t]])
                single = (t == 0, t == 1)
                res = self.run(jaxpr, consts, ins[1:], name, (*key, index[t]), single)
                outs[t] = [o[t] for o in res]
        return list(zip(outs[0], outs[1], strict=True))


def _flops(jaxpr: Any, times: int = 1) -> tuple[int, int]:
    """(matmul FLOPs, those with float32 operands) of a jaxpr; a scan body counts per
    iteration, a while body once, a cond's costliest branch."""
    total = f32 = 0

    def add(sub: Any, n: int) -> None:
        nonlocal total, f32
        t, f = _flops(sub.jaxpr if isinstance(sub, jc.ClosedJaxpr) else sub, n)
        total, f32 = total + t, f32 + f

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            add(eqn.params["jaxpr"], times * eqn.params["length"])
        elif name == "cond":
            costs = [_flops(b.jaxpr, times) for b in eqn.params["branches"]]
            t, f = max(costs)
            total, f32 = total + t, f32 + f
        else:
            subs = [
                s
                for p in eqn.params.values()
                for s in (p if isinstance(p, tuple) else (p,))
                if isinstance(s, (jc.Jaxpr, jc.ClosedJaxpr))
            ]
            for s in subs:
                add(s, times)
            flops = _eqn_flops(eqn) * times
            total += flops
            if flops and all(
                np.dtype(v.aval.dtype).itemsize >= 4 for v in eqn.invars[:2] if _is_float(v.aval)
            ):
                f32 += flops
    return total, f32


# -- compare -----------------------------------------------------------------------------------


def _check_fn(fn: Any, policy: Any, caller: str) -> None:
    if not callable(fn):
        raise TypeError(f"{caller} needs a function, got {type(fn).__name__}.")
    kind = _flax_module_kind(fn)
    if kind is not None:
        raise TypeError(
            f"{caller} takes a function, got the Flax {kind} module {type(fn).__name__}; pass "
            "a function that calls it, e.g. lambda params, x: model.apply(params, x) for a "
            "model wrapped by mpjax.flax.wrap (with policy=None)."
        )
    if policy is not None and not isinstance(policy, Policy):
        hint = (
            "an FP8 policy: compare its half policy, policy.base"
            if type(policy).__name__ == "FP8Policy"
            else "e.g. mpjax.Policy.from_level('O2')"
        )
        raise TypeError(
            f"{caller} needs an mpjax.Policy or None (fn already mixed, as a model wrapped by "
            f"mpjax.flax.wrap), got {type(policy).__name__}; {hint}."
        )


def _policy_text(policy: Policy | None) -> str:
    if policy is None:
        return "fn as it runs"
    if policy.level is not None:
        return f"{policy.level} {np.dtype(policy.compute_dtype).name}"
    return str(policy)


@dataclasses.dataclass
class _Compared:
    report: CompareReport
    program: _Program
    ref: list[Any]  # the float32 program's output leaves
    floats: list[int]  # positions of the floating output leaves
    scale: float  # all float32 outputs' scale, for leaves that are zero up to rounding


def _compare(
    fn: Callable[..., Any], policy: Policy | None, args: tuple[Any, ...], metric: Any
) -> _Compared:
    program = _trace(fn, policy, args, frozenset())
    closed = program.closed
    out_avals = closed.out_avals
    floats = [i for i, a in enumerate(out_avals) if _is_float(a)]
    if not floats:
        dtypes = sorted({str(a.dtype) for a in out_avals}) or ["none"]
        raise ValueError(
            f"compare needs a floating output to measure, but fn returns {', '.join(dtypes)}; "
            "return what precision changes: the logits or the loss (not argmax labels or a "
            "count), or the gradients."
        )
    shadow = _Shadow(metric)
    consts = [(c, _up(c)) for c in closed.consts]
    outs = shadow.run(closed.jaxpr, consts, [(x, _up(x)) for x in program.dyn], "", ())
    scale = _output_scale([outs[i][1] for i in floats], metric)
    outputs = tuple(
        OutputError(
            path=program.out_paths[i],
            dtype=np.dtype(out_avals[i].dtype).name,
            shape=tuple(out_avals[i].shape),
            error=_error(outs[i][0], outs[i][1], metric, scale),
        )
        for i in floats
    )
    rows = [_row(stat) for stat in shadow.stats.values()]
    ranked = tuple(sorted(rows, key=lambda r: (-r.local_error, r.index)))
    first = None
    if shadow.first_nonfinite is not None:
        first = _row(shadow.stats[shadow.first_nonfinite])
    report = CompareReport(
        rows=ranked,
        modules=_modules(ranked),
        outputs=outputs,
        first_nonfinite=first,
        policy=_policy_text(policy),
        metric=_metric_name(metric),
        notes=tuple(shadow.notes),
    )
    return _Compared(report, program, [outs[i][1] for i in floats], floats, scale)


_MPJAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(stat: _Stat) -> CompareRow:
    eqn = stat.eqn
    floats = [v for v in eqn.outvars if _is_float(v.aval)]
    source: str | None = jc.summarize_source(eqn.source_info) or None
    if source and os.path.abspath(source.rsplit(":", 2)[0]).startswith(_MPJAX_DIR + os.sep):
        source = None  # a cast autocast made outside any user op: of the outputs
    return CompareRow(
        index=stat.index,
        primitive=eqn.primitive.name,
        module=_module_of(stat.name),
        name=_clean_name(stat.name),
        source=source,
        dtype=_dtype_text(eqn),
        shape=tuple(floats[0].aval.shape) if floats else (),
        local_error=stat.local,
        error=stat.error,
        runs=stat.runs,
        backward="transpose(" in stat.name,
        nonfinite=stat.nonfinite,
        flops=_eqn_flops(eqn),
    )


def _modules(rows: Sequence[CompareRow]) -> tuple[ModuleError, ...]:
    groups: dict[str, list[CompareRow]] = {}
    for r in rows:
        if r.module is not None:
            groups.setdefault(r.module, []).append(r)
    out = [
        ModuleError(
            module=m,
            local_error=max(r.local_error for r in rs),
            error=max(r.error for r in rs),
            ops=len(rs),
            top=f"{rs[0].primitive} ({_short(rs[0].source)})",  # rows come ranked
        )
        for m, rs in groups.items()
    ]
    return tuple(sorted(out, key=lambda m: -m.local_error))


_HALF_NAME = re.compile(r"float16|bfloat16|float8")


def compare(
    fn: Callable[..., Any], policy: Policy | None, *args: Any, metric: Any = "rms"
) -> CompareReport:
    """Runs `fn` under `policy` beside float32, op by op, and reports where error appears.

    The mixed-precision program (``mpjax.autocast(fn, policy)``, or `fn` itself with
    ``policy=None``) is traced and evaluated eagerly, one equation at a time, on two tracks:
    as it is, and as its float32 shadow, where every float is float32 and a cast to half does
    nothing: the float32 program. For each equation with a floating result it reports

    * the **local error**: the op run as the mixed program runs it (its operands rounded to
      its dtypes) on the float32 program's values, against the op in float32 on the same
      values. This is the error the op itself introduces, and the rows are ranked by it.
    * the **error**: its value in the mixed program against the float32 program's, the error
      accumulated up to there.

    Rows carry the primitive, the dtypes it ran in, the source line and the Flax module path
    (linen's, and NNX's for a model wrapped by :func:`mpjax.flax.wrap`), spelled as
    ``rules=`` keys are. Per module, the worst local error ranks the modules. Loop bodies
    (``scan``, ``while``) run iteration by iteration and give one row per body equation with
    the largest errors over the iterations; ``cond`` runs the branch taken. Calls (``jit``,
    ``custom_jvp``/``custom_vjp``, remat) are evaluated inside, so a jitted function, a
    gradient and a wrapped model compare op by op. The first op that made an inf or NaN from
    finite inputs is named.

    The error metric is relative to the reference's scale, not to each element, so zeros in
    the reference cannot blow it up: "rms" (default) is ``||half - f32||_2 / ||f32||_2`` (the
    normwise relative error, about 2**-11 for one float16 rounding and 2**-8 for bfloat16),
    "max" is ``max|half - f32| / max|f32|``. An inf or NaN on one side only is an error of
    inf; against an all-zero reference the error is absolute. A function ``(half, ref) ->
    float`` of two float64 arrays may be given instead.

    Some outputs are zero in exact arithmetic: the gradient of an attention key's bias
    (softmax ignores a shift shared by all keys) is float32 rounding noise, 1e-6 to 1e-10 of
    the other gradients, and its half error relative to that noise would read 1e2 to 1e4. An
    output leaf whose float32 scale is below 2**-14 of all the outputs' scale (their RMS, or
    max for "max") is measured against all the outputs' scale instead, and reads as the
    other leaves do. A custom metric is applied as it is.

    Gradients: pass the function that computes them. ``jax.grad(mpjax.autocast(loss,
    policy))`` with ``policy=None`` is exactly what a train step runs; ``compare(jax.grad(loss),
    policy, ...)`` autocasts the gradient program, which runs the same dtypes forward and
    close to them backward. Each gradient leaf is an output row. Scale a float16 loss as
    training does, or small gradients underflow.

    Args:
      fn: the function, plain, jitted or one that already runs mixed precision.
      policy: the policy to run `fn` under, or None when `fn` already runs mixed precision
        itself (it calls a model wrapped by ``mpjax.flax.wrap`` or an ``mpjax.autocast``
        function): a policy would autocast the rest of `fn` too, the loss included.
      *args: its arguments: pytrees whose array leaves are the program's inputs; other leaves
        are static.
      metric: "rms", "max" or a function ``(half, ref) -> float``.

    Returns:
      A :class:`CompareReport`; ``str(report)`` is a table, ``report.to_dict()`` and
      ``report.records()`` are plain data.

    Raises:
      TypeError: if `fn` is not a function or `policy` not a Policy or None.
      ValueError: if `fn` has no floating output, or `metric` is unknown.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> def posenc(x):  # NeRF's positional encoding: sin(2**k x)
      ...     return jnp.sin(x[:, None] * 2.0 ** jnp.arange(10))
      >>> x = jnp.linspace(-1.0, 1.0, 256)
      >>> report = mpjax.compare(posenc, mpjax.Policy.from_level("O2", "float16"), x)
      >>> report.rows[0].primitive, report.rows[0].dtype, report.error > 0.01
      ('sin', 'float16', True)
      >>> mpjax.compare(posenc, mpjax.Policy.from_level("O1", "float16"), x).error
      0.0
    """
    _check_fn(fn, policy, "compare")
    report = _compare(fn, policy, args, _check_metric(metric)).report
    if policy is None and not any(_HALF_NAME.search(row.dtype) for row in report.rows):
        warnings.warn(
            "mpjax.compare(fn, None): fn runs no mixed precision (every op ran in float32), so "
            "there is nothing to compare. None is for a function that calls a model wrapped "
            "by mpjax.flax.wrap or mpjax.autocast; otherwise pass the policy to run it under, "
            "e.g. mpjax.compare(fn, mpjax.Policy.from_level('O2'), ...).",
            UserWarning,
            stacklevel=2,
        )
    return report


# -- the search --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class F32Rules:
    """What to keep in float32 so that a function meets a tolerance; from :func:`find_f32_rules`.

    Attributes:
      rules: ``{module path: "O0"}``, for ``mpjax.flax.wrap(module, policy, rules=...)``.
      f32_ops: primitive names to keep in float32, already added to ``policy``.
      policy: the policy searched with `f32_ops` added to its float32 list (for
        ``mpjax.autocast`` and ``mpjax.flax.wrap``); None if None was searched.
      met: whether the outputs meet `tol` with them.
      error: the largest output error with them (jitted program against float32).
      baseline_error: the largest output error without them.
      tol: the tolerance.
      metric: the error metric.
      f32_flop_share: the share of matmul/convolution FLOPs that run in float32 with them.
      baseline_f32_flop_share: the same without them: the difference is what they cost.
      candidates: (candidate, worst local error) in the order searched.
      evaluations: how many programs the search ran.
      report: the comparison the candidates were ranked by.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> f = lambda x: jnp.sin(x[:, None] * 2.0 ** jnp.arange(10))
      >>> found = mpjax.find_f32_rules(f, mpjax.Policy.from_level("O2", "float16"),
      ...                              jnp.linspace(-1.0, 1.0, 256), tol=1e-3)
      >>> sorted(found.f32_ops), found.met
      (['sin'], True)
    """

    rules: dict[str, str]
    f32_ops: frozenset[str]
    policy: Policy | None
    met: bool
    error: float
    baseline_error: float
    tol: float
    metric: str
    f32_flop_share: float
    baseline_f32_flop_share: float
    candidates: tuple[tuple[str, float], ...]
    evaluations: int
    report: CompareReport = dataclasses.field(repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the result (the comparison as ``report.to_dict()``).

        Example:
          >>> import json, jax.numpy as jnp, mpjax
          >>> found = mpjax.find_f32_rules(jnp.sin, mpjax.Policy.from_level("O2", "float16"),
          ...                              jnp.linspace(0.0, 100.0, 64), tol=1e-3)
          >>> d = json.loads(json.dumps(found.to_dict()))
          >>> d["f32_ops"], d["met"]
          (['sin'], True)
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(
            f32_ops=sorted(self.f32_ops),
            policy=None if self.policy is None else str(self.policy),
            candidates=[list(c) for c in self.candidates],
            report=self.report.to_dict(),
        )
        return out

    def __str__(self) -> str:
        kept = [f"module {k or '<root>'}" for k in self.rules] + [
            f"op {o}" for o in sorted(self.f32_ops)
        ]
        verdict = "meets" if self.met else "does NOT meet"
        lines = [
            f"mpjax find_f32_rules ({self.report.policy}, metric {self.metric}): keep in float32: "
            f"{', '.join(kept) or 'nothing'}",
            f"  output error {_fmt(self.error)} {verdict} tol {self.tol:g} (was "
            f"{_fmt(self.baseline_error)})",
            f"  matmul FLOPs in float32: {100 * self.f32_flop_share:.1f}% (was "
            f"{100 * self.baseline_f32_flop_share:.1f}%); {self.evaluations} programs run",
        ]
        if self.rules:
            lines.append(f"  mpjax.flax.wrap(module, policy, rules={self.rules!r})")
        if self.f32_ops:
            lines.append(
                f"  policy = mpjax.Policy.from_level(..., f32_ops={sorted(self.f32_ops)!r})"
            )
        if not self.met:
            lines.append(
                "  even with every candidate in float32 the outputs miss tol: the error comes "
                "from outside them (inputs, the loss, ops outside modules) or tol is below "
                "what float32 itself resolves."
            )
        return "\n".join(lines)


def _with_f32_ops(policy: Policy, names: frozenset[str]) -> Policy:
    return dataclasses.replace(
        policy, f32_ops=policy.f32_ops | names, lower_ops=policy.lower_ops - names
    )


def _check_tol(tol: Any) -> float:
    ok = isinstance(tol, (int, float, np.floating, np.integer)) and not isinstance(tol, bool)
    if not ok or not (0 < float(tol) < math.inf):
        raise ValueError(
            f"tol is the largest output error to accept, a positive number such as 1e-2 (1% "
            f"relative error with metric 'rms'), got {tol!r}."
        )
    return float(tol)


def find_f32_rules(
    fn: Callable[..., Any],
    policy: Policy | None,
    *args: Any,
    tol: float,
    metric: Any = "rms",
    by: str = "auto",
) -> F32Rules:
    """Finds a small set of modules or op kinds to keep in float32 so that `fn` meets `tol`.

    It ranks candidates by :func:`compare`'s local errors (the worst op of each), then, as
    Polygraphy's ``debug precision`` bisects layers, searches: the shortest prefix of the
    ranking whose float32 run meets `tol` (by bisection), then drops each member the others
    do not need. Each trial traces and runs the jitted program with the candidates in
    float32 and measures every floating output leaf (the loss and each gradient leaf, when
    `fn` returns them) against the float32 program with `metric`, as :func:`compare` does
    (a leaf that is zero in exact arithmetic against all the outputs' scale); all must be
    within `tol`.

    Candidates are Flax module paths when `fn` runs Flax modules (linen; NNX wrapped by
    ``mpjax.flax.wrap``), tried as ``rules={path: "O0"}`` of ``mpjax.flax.wrap``, and JAX
    primitive names otherwise, tried as the policy's float32 list (``f32_ops``), where
    autocast also runs the elementwise ops feeding them in float32. The result is what to
    write: ``mpjax.flax.wrap(module, found.policy, rules={**your_rules, **found.rules})`` or
    ``mpjax.autocast(fn, found.policy)``. Its cost is the share of matmul FLOPs left in
    float32 (``found.f32_flop_share`` against ``found.baseline_f32_flop_share``).

    Args:
      fn: the function, as for :func:`compare`: its outputs are what must meet `tol`.
      policy: the policy to run `fn` under, or None when `fn` already runs mixed precision
        (a model wrapped by ``mpjax.flax.wrap``; then only module paths are searched).
      *args: its arguments.
      tol: the largest output error to accept (e.g. 1e-2), in `metric`.
      metric: "rms" (``||half - f32|| / ||f32||``, default), "max", or a function
        ``(half, ref) -> float``.
      by: "modules", "ops", or "auto" (modules where `fn` runs Flax modules).

    Returns:
      An :class:`F32Rules`. With no precision problem (the outputs already meet `tol`) its
      rules and f32_ops are empty. If even every candidate in float32 misses `tol`, ``met``
      is False and they are all returned.

    Raises:
      TypeError: as :func:`compare`.
      ValueError: for a `tol` that is not a positive number, an unknown `metric` or `by`, an
        `fn` with no floating output, or nothing to search (no module paths and no policy).

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> def f(x):  # the subtraction cancels in float16 (about 100 - 100); tanh does not
      ...     return jnp.tanh(x) + jnp.sqrt(x * x + 1e4) - 100.0
      >>> x = jnp.linspace(0.5, 2.0, 64)
      >>> found = mpjax.find_f32_rules(f, mpjax.Policy.from_level("O2", "float16"), x, tol=1e-2)
      >>> sorted(found.f32_ops), found.met, found.baseline_error > 0.01
      (['sub'], True, True)
      >>> found.policy.f32_ops >= {"sub", "exp"}   # the O2 float32 list, and sub
      True
    """
    _check_fn(fn, policy, "find_f32_rules")
    tol = _check_tol(tol)
    metric = _check_metric(metric)
    if by not in ("auto", "modules", "ops"):
        raise ValueError(f"by must be 'auto', 'modules' or 'ops', got {by!r}.")
    base = _compare(fn, policy, args, metric)
    report = base.report
    if by == "auto":
        by = "modules" if report.modules else "ops"
    if by == "ops" and policy is None:
        raise ValueError(
            "find_f32_rules with policy=None searches the module paths of models wrapped by "
            "mpjax.flax.wrap, and fn runs none; pass the policy to search op kinds: "
            "find_f32_rules(fn, mpjax.Policy.from_level('O2'), *args, tol=...)."
        )
    if by == "modules":
        candidates = [(m.module, m.local_error) for m in report.modules]
        if not candidates:
            raise ValueError(
                "by='modules', but fn runs no Flax module this can name (linen modules, or "
                "NNX modules wrapped by mpjax.flax.wrap); use by='ops' with a policy."
            )
    else:
        worst: dict[str, float] = {}
        for r in report.rows:
            half = any(t in r.dtype for t in ("float16", "bfloat16"))
            if half and r.primitive in ops.KNOWN_OPS and r.primitive not in _NOT_CANDIDATES:
                worst[r.primitive] = max(worst.get(r.primitive, 0.0), r.local_error)
        assert policy is not None
        worst = {k: v for k, v in worst.items() if k not in policy.f32_ops}
        candidates = sorted(worst.items(), key=lambda kv: -kv[1])

    trials: dict[frozenset[str], tuple[float, _Program]] = {}

    def trial(chosen: frozenset[str]) -> float:
        if chosen not in trials:
            if by == "modules":
                program = _trace(fn, policy, args, chosen)
            else:
                assert policy is not None
                program = _trace(fn, _with_f32_ops(policy, chosen), args, frozenset())
            outs = jax.jit(jc.jaxpr_as_fun(program.closed))(*program.dyn)
            err = max(
                _error(outs[i], r, metric, base.scale)
                for i, r in zip(base.floats, base.ref, strict=True)
            )
            trials[chosen] = (err, program)
        return trials[chosen][0]

    names = [c for c, _ in candidates]
    baseline = trial(frozenset())
    chosen = frozenset[str]()
    if baseline > tol and names:
        if trial(frozenset(names)) > tol:
            chosen = frozenset(names)
        else:
            lo, hi = 0, len(names)  # prefix lo misses tol, prefix hi meets it
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if trial(frozenset(names[:mid])) <= tol:
                    hi = mid
                else:
                    lo = mid
            chosen = frozenset(names[:hi])
            for name in reversed(names[:hi]):  # the least suspect first
                if len(chosen) > 1 and trial(chosen - {name}) <= tol:
                    chosen = chosen - {name}
    error = trial(chosen)

    def share(program: _Program) -> float:
        total, f32 = _flops(program.closed.jaxpr)
        return f32 / total if total else 0.0

    order = {n: i for i, n in enumerate(names)}
    ranked = sorted(chosen, key=order.__getitem__)
    if by == "modules":
        rules = {_escape(m): "O0" for m in ranked}
        f32_ops: frozenset[str] = frozenset()
        new_policy = policy
    else:
        rules, f32_ops = {}, frozenset(ranked)
        assert policy is not None
        new_policy = _with_f32_ops(policy, f32_ops) if f32_ops else policy
    return F32Rules(
        rules=rules,
        f32_ops=f32_ops,
        policy=new_policy,
        met=error <= tol,
        error=error,
        baseline_error=baseline,
        tol=tol,
        metric=_metric_name(metric),
        f32_flop_share=share(trials[chosen][1]),
        baseline_f32_flop_share=share(trials[frozenset()][1]),
        candidates=tuple(candidates),
        evaluations=len(trials),
        report=report,
    )


def _escape(path: str) -> str:
    """A module path as a ``rules=`` key matching it alone (glob characters escaped)."""
    return glob.escape(path) if any(c in path for c in "*?[") else path
