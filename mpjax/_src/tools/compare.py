"""Where precision is lost: `compare` runs a function's mixed-precision program op by op beside
its float32 shadow (see shadow.py) and reports the error of each op, module and output."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mpjax._src import jax_compat as jc
from mpjax._src import levels
from mpjax._src.dtypes import is_float
from mpjax._src.hardware import HardwareWarning
from mpjax._src.interpreter.autocast_api import autocast, flat_call, flax_module_kind, for_shadow
from mpjax._src.interpreter.module_paths import clean_name, linen_paths, module_of, nnx_paths
from mpjax._src.interpreter.values import dynamic_leaves
from mpjax._src.policy import Policy
from mpjax._src.tools.audit_report import short_source
from mpjax._src.tools.compare_metric import check_metric, metric_name, output_scale, relative_error
from mpjax._src.tools.compare_report import CompareReport, CompareRow, ModuleError, OutputError
from mpjax._src.tools.shadow import Shadow, Stat, dtype_text, eqn_flops, to_f32


@dataclasses.dataclass
class Program:
    closed: Any
    out_tree: Any
    dyn: list[Any]
    out_paths: list[str]


def trace_program(
    fn: Callable[..., Any], policy: Policy | None, args: tuple[Any, ...], keep: frozenset[str]
) -> Program:
    """The mixed-precision program of `fn` at `args`: ``autocast(fn, policy)`` (or `fn` as it
    is), with every Flax module's ops named by path and the paths in `keep` run as O0 rules."""
    from jax.experimental.xla_metadata import set_xla_metadata

    leaves, treedef = jax.tree_util.tree_flatten((args, {}))
    dynamic = dynamic_leaves(leaves)
    dyn = [leaves[i] for i in dynamic]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HardwareWarning)  # a comparison is not a speed run
        run = fn if policy is None else autocast(fn, policy)
    flat = flat_call(run, leaves, treedef, dynamic)
    # Functions traced before (a jitted step, an autocast function) are traced again: jax.jit
    # keys its cache on XLA metadata among other things, and autocast keeps the traces made
    # for a shadow apart (autocast.for_shadow).
    cache = "mpjax.compare:" + hashlib.sha1(repr(sorted(keep)).encode()).hexdigest()[:12]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", HardwareWarning)
            with for_shadow(cache), linen_paths(keep), nnx_paths(keep):
                with set_xla_metadata(mpjax_compare=cache):
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
    with_path, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    paths = [jax.tree_util.keystr(p) for p, _ in with_path]
    return Program(closed, out_tree, dyn, paths)


# -- compare -----------------------------------------------------------------------------------


def check_fn(fn: Any, policy: Any, caller: str) -> None:
    if not callable(fn):
        raise TypeError(f"{caller} needs a function, got {type(fn).__name__}.")
    kind = flax_module_kind(fn)
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
    if levels.of(policy).name is not None:
        return f"{policy.level} {np.dtype(policy.compute_dtype).name}"
    return str(policy)


@dataclasses.dataclass
class _Compared:
    report: CompareReport
    program: Program
    ref: list[Any]  # the float32 program's output leaves
    floats: list[int]  # positions of the floating output leaves
    scale: float  # all float32 outputs' scale, for leaves that are zero up to rounding


def run_compare(
    fn: Callable[..., Any], policy: Policy | None, args: tuple[Any, ...], metric: Any
) -> _Compared:
    program = trace_program(fn, policy, args, frozenset())
    closed = program.closed
    out_avals = closed.out_avals
    floats = [i for i, a in enumerate(out_avals) if is_float(a)]
    if not floats:
        dtypes = sorted({str(a.dtype) for a in out_avals}) or ["none"]
        raise ValueError(
            f"compare needs a floating output to measure, but fn returns {', '.join(dtypes)}; "
            "return what precision changes: the logits or the loss (not argmax labels or a "
            "count), or the gradients."
        )
    shadow = Shadow(metric)
    consts = [(c, to_f32(c)) for c in closed.consts]
    outs = shadow.run(closed.jaxpr, consts, [(x, to_f32(x)) for x in program.dyn], "", ())
    scale = output_scale([outs[i][1] for i in floats], metric)
    outputs = tuple(
        OutputError(
            path=program.out_paths[i],
            dtype=np.dtype(out_avals[i].dtype).name,
            shape=tuple(out_avals[i].shape),
            error=relative_error(outs[i][0], outs[i][1], metric, scale),
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
        metric=metric_name(metric),
        notes=tuple(shadow.notes),
    )
    return _Compared(report, program, [outs[i][1] for i in floats], floats, scale)


_MPJAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(stat: Stat) -> CompareRow:
    eqn = stat.eqn
    floats = [v for v in eqn.outvars if is_float(v.aval)]
    source: str | None = jc.summarize_source(eqn.source_info) or None
    if source and os.path.abspath(source.rsplit(":", 2)[0]).startswith(_MPJAX_DIR + os.sep):
        source = None  # a cast autocast made outside any user op: of the outputs
    return CompareRow(
        index=stat.index,
        primitive=eqn.primitive.name,
        module=module_of(stat.name),
        name=clean_name(stat.name),
        source=source,
        dtype=dtype_text(eqn),
        shape=tuple(floats[0].aval.shape) if floats else (),
        local_error=stat.local,
        error=stat.error,
        runs=stat.runs,
        backward="transpose(" in stat.name,
        nonfinite=stat.nonfinite,
        flops=eqn_flops(eqn),
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
            top=f"{rs[0].primitive} ({short_source(rs[0].source)})",  # rows come ranked
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
    check_fn(fn, policy, "compare")
    report = run_compare(fn, policy, args, check_metric(metric)).report
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
