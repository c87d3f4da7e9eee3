"""The results of mpjax.compare: rows per op, errors per module and output, and the report."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mpjax._src.tools.audit_report import short_source
from mpjax._src.tools.compare_metric import METRIC_TEXT

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
        line = short_source(self.source) if self.source else "<autocast>"
        return line if self.module is None else f"{self.module or '<root>'} ({line})"

    def __str__(self) -> str:
        made = f", {self.nonfinite} made here" if self.nonfinite else ""
        return (
            f"{self.primitive}{' (bwd)' if self.backward else ''} -> {self.dtype}"
            f"{list(self.shape)} at {self.where()}: local error {fmt(self.local_error)}, "
            f"error {fmt(self.error)}{made}"
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
            f"{self.metric}{METRIC_TEXT.get(self.metric, '')}",
            "",
            "| output | dtype | shape | error |",
            "|---|---|---|---:|",
        ]
        lines += [
            f"| {o.path or '<output>'} | {o.dtype} | {list(o.shape)} | {fmt(o.error)} |"
            for o in self.outputs
        ]
        if self.modules:
            lines += [
                "",
                "| module | local error | error | ops | worst op |",
                "|---|---:|---:|---:|---|",
            ]
            lines += [
                f"| {m.module or '<root>'} | {fmt(m.local_error)} | {fmt(m.error)} | {m.ops} "
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
                f"| {r.index} | {op} | {r.dtype} | {list(r.shape)} | {fmt(r.local_error)} | "
                f"{fmt(r.error)} | {r.runs} | {r.where()} |"
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


def fmt(x: float) -> str:
    return "inf" if math.isinf(x) else ("0" if x == 0 else f"{x:.2e}")
