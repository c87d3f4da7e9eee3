"""find_f32_rules: the few modules or op kinds to keep in float32 so that outputs meet a
tolerance."""

from __future__ import annotations

import dataclasses
import glob
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpjax._src import jax_compat as jc
from mpjax._src.interpreter import ops
from mpjax._src.interpreter.ops import Trait
from mpjax._src.policy import Policy
from mpjax._src.tools.compare import Program, check_fn, run_compare, trace_program
from mpjax._src.tools.compare_metric import check_metric, metric_name, relative_error
from mpjax._src.tools.compare_report import CompareReport, fmt
from mpjax._src.tools.shadow import count_flops

# The cast, ops that decide by an order and ops that only move data: never candidates for
# the float32 list.
NOT_CANDIDATES = ops.having(Trait.CAST | Trait.ORDERS | Trait.MOVES | Trait.PASSES)


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
            f"  output error {fmt(self.error)} {verdict} tol {self.tol:g} (was "
            f"{fmt(self.baseline_error)})",
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
    check_fn(fn, policy, "find_f32_rules")
    tol = _check_tol(tol)
    metric = check_metric(metric)
    if by not in ("auto", "modules", "ops"):
        raise ValueError(f"by must be 'auto', 'modules' or 'ops', got {by!r}.")
    base = run_compare(fn, policy, args, metric)
    report = base.report
    by, candidates = _candidates(by, report, policy)
    trials = _Trials(fn, policy, args, by, base, metric)
    names = [c for c, _ in candidates]
    baseline = trials(frozenset())
    chosen = _smallest_set(names, trials, tol) if baseline > tol and names else frozenset()
    error = trials(chosen)

    def share(program: Program) -> float:
        total, f32 = count_flops(program.closed.jaxpr)
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
        metric=metric_name(metric),
        f32_flop_share=share(trials.programs[chosen]),
        baseline_f32_flop_share=share(trials.programs[frozenset()]),
        candidates=tuple(candidates),
        evaluations=len(trials.errors),
        report=report,
    )


def _candidates(by: str, report: Any, policy: Policy | None) -> tuple[str, list[Any]]:
    """What the search chooses from, ("modules" or "ops", [(name, local error)])."""
    if by == "auto":
        by = "modules" if report.modules else "ops"
    if by == "ops" and policy is None:
        raise ValueError(
            "find_f32_rules with policy=None searches the module paths of models wrapped by "
            "mpjax.flax.wrap, and fn runs none; pass the policy to search op kinds: "
            "find_f32_rules(fn, mpjax.Policy.from_level('O2'), *args, tol=...)."
        )
    if by == "ops":
        assert policy is not None
        return by, _op_candidates(report, policy)
    candidates = [(m.module, m.local_error) for m in report.modules]
    if not candidates:
        raise ValueError(
            "by='modules', but fn runs no Flax module this can name (linen modules, or "
            "NNX modules wrapped by mpjax.flax.wrap); use by='ops' with a policy."
        )
    return by, candidates


class _Trials:
    """The search's evaluations: the error of `fn` with a set of candidates in float32, each
    set traced and run once."""

    def __init__(
        self, fn: Any, policy: Policy | None, args: Any, by: str, base: Any, metric: Any
    ) -> None:
        self.fn, self.policy, self.args, self.by = fn, policy, args, by
        self.base, self.metric = base, metric
        self.errors: dict[frozenset[str], float] = {}
        self.programs: dict[frozenset[str], Program] = {}

    def __call__(self, chosen: frozenset[str]) -> float:
        if chosen not in self.errors:
            if self.by == "modules":
                program = trace_program(self.fn, self.policy, self.args, chosen)
            else:
                assert self.policy is not None
                policy = _with_f32_ops(self.policy, chosen)
                program = trace_program(self.fn, policy, self.args, frozenset())
            outs = jax.jit(jc.jaxpr_as_fun(program.closed))(*program.dyn)
            base = self.base
            self.errors[chosen] = max(
                relative_error(outs[i], r, self.metric, base.scale)
                for i, r in zip(base.floats, base.ref, strict=True)
            )
            self.programs[chosen] = program
        return self.errors[chosen]


def _op_candidates(report: Any, policy: Policy) -> list[tuple[str, float]]:
    """The op kinds that ran in half, by their worst local error, most suspect first."""
    worst: dict[str, float] = {}
    for r in report.rows:
        half = any(t in r.dtype for t in ("float16", "bfloat16"))
        if half and r.primitive in ops.KNOWN_OPS and r.primitive not in NOT_CANDIDATES:
            worst[r.primitive] = max(worst.get(r.primitive, 0.0), r.local_error)
    worst = {k: v for k, v in worst.items() if k not in policy.f32_ops}
    return sorted(worst.items(), key=lambda kv: -kv[1])


def _smallest_set(
    names: list[str], trial: Callable[[frozenset[str]], float], tol: float
) -> frozenset[str]:
    """A small set of `names` (most suspect first) whose `trial` error is within `tol`: the
    shortest such prefix, by bisection, then each name dropped that is not needed, the least
    suspect first. All of `names` when even that misses `tol`."""
    if trial(frozenset(names)) > tol:
        return frozenset(names)
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
    return chosen


def _escape(path: str) -> str:
    """A module path as a ``rules=`` key matching it alone (glob characters escaped)."""
    return glob.escape(path) if any(c in path for c in "*?[") else path
