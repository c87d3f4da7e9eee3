"""What the audit found: matmuls, risks and collectives, and the report that lists them."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from mpjax._src.interpreter.module_paths import module_path
from mpjax._src.interpreter.regions import F32_REGION
from mpjax._src.tools.gpu_program import GpuProgram
from mpjax._src.tools.tpu_program import TpuProgram

HALF_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class MatmulOp:
    """One dot_general or convolution of the program."""

    kind: str
    operand_dtypes: tuple[str, ...]
    result_dtype: str
    operand_shapes: tuple[tuple[int, ...], ...]
    result_shape: tuple[int, ...]
    flops: int
    name: str | None
    source: str | None
    aligned: bool
    # For each operand, the float8 dtype it was dequantized from right before the op (None
    # where it was not): how an FP8 matmul appears in a lowered module (mpjax.fp8, Flax's
    # fp8_ops, TransformerEngine's JAX ops), and the pattern XLA's GPU compiler rewrites into
    # an FP8 GEMM. Empty when neither operand is.
    fp8_dtypes: tuple[str | None, ...] = ()

    @property
    def half(self) -> bool:
        """Both operands in float16 or bfloat16."""
        return all(d in HALF_DTYPES for d in self.operand_dtypes)

    @property
    def fp8(self) -> bool:
        """Both operands in float8, or dequantized from float8 right before the op."""
        return len(self.fp8_dtypes) == 2 and all(d is not None for d in self.fp8_dtypes)


@dataclasses.dataclass(frozen=True)
class Risk:
    """An op of the float32 list that ran in half precision."""

    op: str
    dtype: str
    shape: tuple[int, ...]
    name: str | None
    source: str | None


@dataclasses.dataclass(frozen=True)
class Collective:
    """A cross-device collective: in the lowered program (explicit, e.g. psum, stage
    "lowered"), or placed by the SPMD partitioner for sharded arrays (stage "partitioned",
    with its result's shape and bytes per device), or in the backend's optimized program
    (stage "compiled"; the CPU backend widens bfloat16 collectives to float32 there, so
    dtypes are read from the "partitioned" stage)."""

    kind: str
    dtypes: tuple[str, ...]
    stage: str
    shape: tuple[int, ...] = ()
    bytes: int = 0
    name: str = ""  # the op it came from ("transpose(...)" in it: the backward pass)


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What a function runs in which precision. ``str(report)`` is a table.

    Attributes:
      matmuls: every dot_general and convolution of the lowered program, in program order
        (those of a function called from several places once per call). FP8 ones (see
        ``fp8_matmuls``) have half operands dequantized from float8 just before the op.
      converts: the number of dtype conversions.
      risks: float32-list ops (exp, log, rsqrt, sums, ...) that run in half precision. An
        exp that cannot overflow is left out: one of ``-x*x`` or ``-|x|`` (erf's derivative)
        or one that only feeds ``c / (k + exp)`` (JAX's lowering of sigmoid, so silu).
      untouched: primitives autocast ran in their traced dtype: by design (linear algebra,
        collectives, ...), because it does not know them, or because it could not rebuild a
        body (a loop's, a shard_map's); ``untouched_why`` gives the reason for each.
      compiled_matmuls: (kind, operand dtypes) of the matmuls in the backend's optimized HLO,
        or None if it could not be compiled. On CPU, XLA may run half matmuls in float32.
      backend: the backend the program was lowered for.
      collectives: all-reduces, reduce-scatters, all-gathers and all-to-alls with their
        dtypes, explicit ("lowered"), placed by the SPMD partitioner for sharded arrays
        ("partitioned", with bytes per device) and in the optimized program ("compiled").
      untouched_why: why autocast left each of ``untouched`` in its traced dtype.
      gpu: with ``audit(..., target=)``, the program XLA compiled for that GPU: kernels by
        kind, bytes moved, gemm dtypes, temp memory, folded casts (a ``GpuProgram``).
      tpu: with a TPU target (``target="tpu-v5e"``), the program XLA compiled for it: its
        fusions, HBM bytes, matmul dtypes, temp memory, collectives (a ``TpuProgram``).

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> report = mpjax.audit(lambda a, b: a @ b, jnp.ones((8, 16)), jnp.ones((16, 8)))
      >>> report.total_flops, report.half_flop_share, report.to_dict()["converts"]
      (2048, 0.0, 0)
    """

    matmuls: tuple[MatmulOp, ...]
    converts: int
    risks: tuple[Risk, ...]
    untouched: tuple[str, ...]
    compiled_matmuls: tuple[tuple[str, tuple[str, ...]], ...] | None
    backend: str
    collectives: tuple[Collective, ...] = ()
    untouched_why: tuple[str, ...] = ()
    gpu: GpuProgram | None = None
    tpu: TpuProgram | None = None

    def collective_bytes(self) -> dict[str, int]:
        """Bytes per device that the partitioned program's collectives move, by dtype.

        Read from the HLO right after SPMD partitioning, before the backend widens or merges
        collectives: what a sharded step sends, in the dtypes it chose.

        Example:
          >>> import jax, jax.numpy as jnp, mpjax
          >>> mpjax.audit(lambda a: a @ a, jnp.ones((8, 8))).collective_bytes()  # one device
          {}
        """
        totals: dict[str, int] = {}
        for c in self.collectives:
            if c.stage == "partitioned" and c.dtypes:
                totals[c.dtypes[0]] = totals.get(c.dtypes[0], 0) + c.bytes
        return totals

    @property
    def total_flops(self) -> int:
        """FLOPs of all matmuls and convolutions.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> mpjax.audit(lambda a, b: a @ b, jnp.ones((4, 8)), jnp.ones((8, 2))).total_flops
          128
        """
        return sum(m.flops for m in self.matmuls)

    @property
    def half_flop_share(self) -> float:
        """The share of matmul/conv FLOPs whose operands are half (0.0 with no matmuls).

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> def f(a, b):  # two matmuls of the same size, one in float16
          ...     return a.astype(jnp.float16) @ b.astype(jnp.float16), a @ b
          >>> mpjax.audit(f, jnp.ones((8, 8)), jnp.ones((8, 8))).half_flop_share
          0.5
        """
        total = self.total_flops
        return sum(m.flops for m in self.matmuls if m.half) / total if total else 0.0

    @property
    def fp8_matmuls(self) -> tuple[MatmulOp, ...]:
        """The matmuls whose operands are float8 or dequantized from it right before them.

        Example:
          >>> import jax.numpy as jnp, mpjax, mpjax.fp8
          >>> f = lambda w, x: jnp.sum(x @ w)
          >>> pol = mpjax.fp8.policy("O2")
          >>> w, x = jnp.ones((32, 16)), jnp.ones((16, 32))
          >>> state = mpjax.fp8.init(f, pol, w, x)
          >>> report = mpjax.audit(mpjax.fp8.scaled_value_and_grad(f, pol), state, w, x)
          >>> [m.fp8_dtypes for m in report.fp8_matmuls], report.fp8_flop_share
          ([('float8_e4m3fn', 'float8_e4m3fn'), ('float8_e5m2', 'float8_e4m3fn')], 1.0)
        """
        return tuple(m for m in self.matmuls if m.fp8)

    @property
    def fp8_fallbacks(self) -> tuple[str, ...]:
        """With ``audit(..., target=)``: the FP8 matmuls that the compiled GPU program runs as
        half gemms (their float8 lost to XLA's passes), by scope (the op name less its last
        part); () without a target or when every one stayed FP8.

        Counted per scope: the compiled program's half gemms beyond the half matmuls the
        program has there, where it also has FP8 ones. A dequantize-then-dot pattern with
        run-time scales (Flax's ``fp8_ops``) loses its float8 on XLA's default gemm path;
        :mod:`mpjax.fp8`'s dots take float8 operands and keep it.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> mpjax.audit(lambda a, b: a @ b, jnp.ones((8, 8)), jnp.ones((8, 8))).fp8_fallbacks
          ()
        """
        if self.gpu is None:
            return ()
        scope = lambda name: name.rsplit("/", 1)[0]
        fp8 = {scope(m.name) for m in self.fp8_matmuls if m.name}
        half = collections.Counter(scope(m.name) for m in self.matmuls if m.name and not m.fp8)
        compiled = collections.Counter(
            scope(k.op_name)
            for k in self.gpu.kernels
            if k.kind == "gemm" and not all(d.startswith("f8") for d in k.gemm_dtypes)
        )
        out: list[str] = []
        for where, n in sorted(compiled.items()):
            if where in fp8 and n > half[where]:
                out += [where] * (n - half[where])
        return tuple(out)

    @property
    def fp8_flop_share(self) -> float:
        """The share of matmul/conv FLOPs run in FP8 (0.0 with no matmuls).

        Example:
          >>> import jax.numpy as jnp, mpjax, mpjax.fp8
          >>> f, pol = lambda w, v, x: (x @ w) @ v, mpjax.fp8.policy()  # v too narrow for FP8
          >>> w, v, x = jnp.ones((32, 16)), jnp.ones((16, 8)), jnp.ones((16, 32))
          >>> state = mpjax.fp8.init(f, pol, w, v, x)
          >>> mpjax.audit(mpjax.fp8.apply(f, pol), state, w, v, x).fp8_flop_share
          0.8
        """
        total = self.total_flops
        return sum(m.flops for m in self.fp8_matmuls) / total if total else 0.0

    @property
    def misaligned(self) -> tuple[MatmulOp, ...]:
        """Half matmuls with a dimension that is not a multiple of 8 (slow on tensor cores).

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> f = lambda a, b: a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16)
          >>> report = mpjax.audit(f, jnp.ones((4, 12)), jnp.ones((12, 8)))
          >>> [m.operand_shapes for m in report.misaligned]   # 12 is not a multiple of 8
          [((4, 12), (12, 8))]
        """
        return tuple(m for m in self.matmuls if m.half and not m.aligned)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of the report, for tests and CI.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> d = mpjax.audit(lambda a, b: a @ b, jnp.ones((8, 16)), jnp.ones((16, 8))).to_dict()
          >>> d["total_flops"], d["matmuls"][0]["kind"], d["matmuls"][0]["operand_dtypes"]
          (2048, 'dot_general', ('float32', 'float32'))
        """
        return {
            "backend": self.backend,
            "matmuls": [
                dataclasses.asdict(m) | {"half": m.half, "fp8": m.fp8} for m in self.matmuls
            ],
            "total_flops": self.total_flops,
            "half_flop_share": self.half_flop_share,
            "fp8_matmuls": len(self.fp8_matmuls),
            "fp8_flop_share": self.fp8_flop_share,
            "fp8_fallbacks": list(self.fp8_fallbacks),
            "converts": self.converts,
            "risks": [dataclasses.asdict(r) for r in self.risks],
            "untouched": list(self.untouched),
            "untouched_why": list(self.untouched_why),
            "misaligned": len(self.misaligned),
            "collectives": [dataclasses.asdict(c) for c in self.collectives],
            "compiled_matmuls": None
            if self.compiled_matmuls is None
            else [{"kind": k, "operand_dtypes": list(d)} for k, d in self.compiled_matmuls],
            "gpu": None if self.gpu is None else self.gpu.to_dict(),
            "tpu": None if self.tpu is None else self.tpu.to_dict(),
        }

    def assert_matmuls_in(self, dtype: Any) -> None:
        """Raises AssertionError naming each matmul whose operands are not all `dtype`.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> f = lambda w, x: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
          >>> mpjax.audit(f, jnp.ones((8, 8)), jnp.ones((8, 8))).assert_matmuls_in(jnp.bfloat16)
        """
        want = np.dtype(dtype).name
        bad = [m for m in self.matmuls if any(d != want for d in m.operand_dtypes)]
        if bad:
            lines = [
                f"  {m.kind} {' x '.join(m.operand_dtypes)} {m.operand_shapes} at "
                f"{m.source or 'unknown source'} ({m.name or 'unnamed'})"
                for m in bad
            ]
            raise AssertionError(
                f"{len(bad)} of {len(self.matmuls)} matmuls are not in {want}:\n" + "\n".join(lines)
            )

    def assert_collectives_in(self, policy: Any, reference: AuditReport | None = None) -> None:
        """Raises AssertionError naming each collective that moves float32 (or float64) where
        `policy` computes in half, beyond what it asks for and what `reference` moves.

        Read from the program after SPMD partitioning (stage "partitioned"). Allowed wide:
        gradient reductions (the backward pass's all-reduces and reduce-scatters) when the
        policy reduces in float32 (:attr:`mpjax.Policy.reduce_dtype`); what the policy's own
        float32 regions move (a norm's float32 params gathered for its float32 island, its
        float32 cotangent resharded: the policy asks for float32 there, as ``keep_norm_fp32``
        says); and, with a `reference` (the audit of the hand-written half step), the wide
        collectives it moves too, matched by kind, shape and dtype (a loss's or a norm's
        float32 statistics). Nothing to check on one device, or for a policy that computes
        in float32.

        Example:
          >>> import jax, jax.numpy as jnp, mpjax
          >>> policy = mpjax.Policy.from_level("O2", "bfloat16")
          >>> mpjax.audit(lambda a: a @ a, jnp.ones((8, 8))).assert_collectives_in(policy)
        """
        if not policy.half:
            return
        asked = np.dtype(policy.gradient_dtype).itemsize >= 4
        wide = [
            c
            for c in self.collectives
            if c.stage == "partitioned"
            and c.dtypes
            and c.dtypes[0] in ("float32", "float64")
            and not (
                asked and c.kind in ("all-reduce", "reduce-scatter") and "transpose(" in c.name
            )
            and _F32_REGION not in c.name
        ]
        if reference is not None:
            key = lambda c: (c.kind, c.shape, c.dtypes[0] if c.dtypes else "")
            budget = collections.Counter(
                key(c) for c in reference.collectives if c.stage == "partitioned"
            )
            kept = []
            for c in wide:
                if budget[key(c)] > 0:
                    budget[key(c)] -= 1
                else:
                    kept.append(c)
            wide = kept
        if wide:
            lines = [
                f"  {c.kind} {c.dtypes[0]}{list(c.shape)} {c.bytes} B/device "
                f"({c.name or 'unnamed'})"
                for c in wide
            ]
            raise AssertionError(
                f"{len(wide)} collectives move {wide[0].dtypes[0]} where the policy "
                f"({policy}) computes in {np.dtype(policy.compute_dtype).name} and reduces "
                f"gradients in {np.dtype(policy.gradient_dtype).name}:\n" + "\n".join(lines)
            )

    def __str__(self) -> str:
        fp8 = self.fp8_matmuls
        fp8_note = (
            f" ({len(fp8)} matmuls, {100 * self.fp8_flop_share:.1f}% of FLOPs, in FP8)"
            if fp8
            else ""
        )
        rows = [
            f"mpjax audit ({self.backend}): {len(self.matmuls)} matmuls, "
            f"{100 * self.half_flop_share:.1f}% of {self.total_flops:,} FLOPs in half{fp8_note}, "
            f"{self.converts} converts, {len(self.risks)} f32-list ops in half",
            "",
            "| op | operands | result | shapes | GFLOP | tensor-core aligned | where |",
            "|---|---|---|---|---:|---|---|",
        ]
        for m in self.matmuls:
            shapes = " x ".join("[" + ",".join(map(str, s)) + "]" for s in m.operand_shapes)
            operands = " x ".join(
                d if q is None or q == d else f"{q}->{d}"
                for d, q in zip(m.operand_dtypes, m.fp8_dtypes or (None,) * 2, strict=False)
            )
            rows.append(
                f"| {m.kind} | {operands} | {m.result_dtype} | {shapes} | "
                f"{m.flops / 1e9:.4f} | {'yes' if m.aligned else 'no'} | "
                f"{_where(m.name, m.source)} |"
            )
        if self.risks:
            rows += ["", "f32-list ops in half (overflow/accuracy risks):"]
            rows += [
                f"  {r.op} {r.dtype}{list(r.shape)} at {_where(r.name, r.source)}"
                for r in self.risks
            ]
            rows += _risk_advice(self.risks)
        if self.misaligned:
            rows += [
                "",
                f"advice: {len(self.misaligned)} half matmul(s) have a dimension that is not a "
                "multiple of 8; pad it for tensor cores.",
            ]
        if self.untouched:
            why = self.untouched_why or ("",) * len(self.untouched)
            rows += ["", "autocast left in their traced dtype:"]
            rows += [f"  {p}: {w}" if w else f"  {p}" for p, w in zip(self.untouched, why)]
        if self.collectives:
            rows += ["", "collectives:"]
            rows += [f"  {c.kind} {' '.join(c.dtypes)} ({c.stage})" for c in self.collectives]
        if self.compiled_matmuls is not None:
            kinds = sorted({" x ".join(d) for _, d in self.compiled_matmuls if d})
            rows += ["", f"backend runs matmuls as: {'; '.join(kinds) or 'none found'}"]
        if self.gpu is not None:
            rows += ["", str(self.gpu)]
            lost = self.fp8_fallbacks
            if lost:
                rows.append(
                    f"  {len(lost)} FP8 matmul(s) run as half gemms here (float8 lost to "
                    "XLA's passes): " + ", ".join(dict.fromkeys(lost))
                )
        if self.tpu is not None:
            rows += ["", str(self.tpu)]
        return "\n".join(rows)


# The scope of the policy's float32 regions (norms kept in float32) in op names.
_F32_REGION = f"mpjax:{F32_REGION}/"


def _risk_advice(risks: tuple[Risk, ...]) -> list[str]:
    """What to do about the risks: gradient sums (a reduce_sum in the backward pass, the
    gradient of a bias or of any broadcast) are the policy's choice of gradient dtype; the
    rest are forward ops that autocast or an f32 list would run in float32."""
    backward = sum(1 for r in risks if r.op == "reduce_sum" and "transpose(" in (r.name or ""))
    rows = []
    if backward:
        rows.append(
            f"advice: {backward} of them are gradient sums of the backward pass (a bias's or a "
            "broadcast's gradient): a half policy sums gradients in its compute dtype, as the "
            "hand-written half step does; Policy.from_level(..., reduce_dtype=jnp.float32) "
            "sums them in float32 (see Policy.gradient_dtype)."
        )
    if len(risks) > backward:
        rows.append(
            f"advice: {len(risks) - backward} forward op(s): mpjax.autocast(fn, policy) at O1 "
            "or O2 runs the float32 list in float32 (add an op with f32_ops=)."
        )
    return rows


def short_source(source: str | None) -> str:
    if not source:
        return "?"
    path, _, line = source.rpartition(":")
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def _module_path(name: str | None) -> str | None:
    """The module path in an op's name stack, ``Net/Dense_0`` from
    ``jit(step)/transpose(jvp(Net))/Dense_0/dot_general``; None where it has none."""
    return module_path((name or "").rpartition("/")[0])  # the last part is the primitive


def _where(name: str | None, source: str | None) -> str:
    """``Net/Dense_0 (linear.py:287)``: a library's line is the same for each of its layers,
    so the module path tells them apart."""
    path = _module_path(name)
    if path is None:
        return short_source(source)
    return f"{path} ({short_source(source)})" if source else path
