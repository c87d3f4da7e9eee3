"""The program XLA compiles for an NVIDIA GPU, read on any machine: its kernels by kind, the
bytes they move, the dtypes its gemms run in and its compiled memory.

JAX compiles for a GPU it does not have through a compile-only topology of the CUDA plugin
(``jax.experimental.topologies``): XLA's whole GPU pipeline runs (fusion, gemm rewriting,
scheduling), and the compiled program's text is the optimized GPU HLO. Without a device XLA
cannot autotune, so gemms are compared as cuBLAS calls (``gemm="cublas"``, the default); XLA's
default path (``gemm="triton"``) gets untuned Triton tiles.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import math
import os
import re
from typing import Any

import jax

from mpjax._src.tools.gpu_flops import _flops
from mpjax._src.tools.hlo_text import (
    _COLLECTIVES,
    _CONTROL,
    _DMA,
    _FLOATS,
    _FREE,
    _arrays,
    _bytes,
    _called,
    _Computation,
    _dtype_of,
    _element_bits,
    _find,
    _Instr,
    _parse,
)

# A GpuTargetConfig text proto (xla/stream_executor/device_description.proto) for an H100 SXM,
# as openxla/xla#25919 and jax-ml/jax#28376 show one.
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# A B200 (Blackwell, compute capability 10.0): 148 SMs, 8 TB/s of HBM3e, 126 MB of L2.
B200 = (
    H100.replace("core_count: 132", "core_count: 148")
    .replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 8000000000000")
    .replace("l2_cache_size: 52428800", "l2_cache_size: 132120576")
    .replace("clock_rate_ghz: 1.98", "clock_rate_ghz: 1.965")
    .replace("device_memory_size: 84929347584", "device_memory_size: 191514689536")
    .replace("cuda_compute_capability { major: 9 }", "cuda_compute_capability { major: 10 }")
    .replace("NVIDIA H100 80GB HBM3", "NVIDIA B200")
    # the cuDNN jax[cuda12] installs today: XLA makes block-scaled dots cuDNN's from 9.10
    # (with an older one it dequantizes them silently into a float32 gemm)
    .replace("dnn_version_info { major: 9 minor: 7 }", "dnn_version_info { major: 9 minor: 28 }")
)

# An H200 (Hopper, as the H100, with 141 GB of HBM3e at 4.8 TB/s): the GPU this project's
# measured rows come from.
H200 = (
    H100.replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 4800000000000")
    .replace("device_memory_size: 84929347584", "device_memory_size: 150754820096")
    .replace("NVIDIA H100 80GB HBM3", "NVIDIA H200")
)

TARGETS = {"h100": H100, "h200": H200, "b200": B200}


def target_name(target: str) -> str:
    """A target's key in TARGETS (names in any case: "H100" is "h100"), or the text proto
    itself."""
    lowered = target.strip().lower()
    return lowered if lowered in TARGETS else target


# XLA options per gemm path: without a device no autotuning, so cuBLAS calls compare variants
# on equal terms; "triton" is XLA's default path with its untuned tiles.
_GEMM_OPTIONS: dict[str, dict[str, Any]] = {
    "cublas": {"xla_gpu_enable_triton_gemm": False},
    "triton": {},
}

_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def _install_hint() -> str:
    v = jax.__version__
    return (
        "compiling for a GPU target needs JAX's CUDA plugin (no GPU or NVIDIA libraries): "
        f"pip install --no-deps jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}"
    )


def _cuda_topology(config: str) -> Any:
    """The compile-only topology of one GPU of `config`, or None where no CUDA plugin has
    registered one (JAX answers NotImplementedError then)."""
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config)
    except NotImplementedError:
        return None


def _register(plugin_name: str) -> bool:
    """Registers JAX's CUDA plugin `plugin_name` past its CUDA version check, which fails on
    a machine without CUDA and so leaves the plugin unregistered; False if not installed."""
    try:
        plugin = importlib.import_module(plugin_name)
    except ImportError:
        return False
    saved = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    try:
        plugin.initialize()
    finally:
        if saved is None:
            del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
    return True


def _topology(config: str) -> Any:
    found = _cuda_topology(config)
    for name in _PLUGINS:
        if found is not None:
            break
        if _register(name):
            found = _cuda_topology(config)
    if found is None:
        raise RuntimeError(_install_hint())
    return found


_SHARDINGS: dict[str, Any] = {}


def target_config(target: str) -> str:
    """The GpuTargetConfig text of `target` (a name in TARGETS, or the text itself)."""
    return TARGETS.get(target_name(target), target)


def _sharding(target: str) -> Any:
    """A replicated sharding on `target`'s one compile-only device."""
    config = target_config(target)
    if "gpu_device_info" not in config:
        raise ValueError(
            f"unknown GPU target {target!r}: use one of {sorted(TARGETS)} or pass a "
            "GpuTargetConfig text proto (its gpu_device_info as XLA's "
            "device_description.proto has it)."
        )
    if config not in _SHARDINGS:
        from jax.experimental import topologies

        mesh = topologies.make_mesh(_topology(config), (1,), ("x",))
        _SHARDINGS[config] = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return _SHARDINGS[config]


def _abstract(leaf: Any, sharding: Any) -> Any:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        weak = bool(getattr(leaf, "weak_type", False))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding, weak_type=weak)
    return leaf


def on_target(tree: Any, target: str = "h100") -> Any:
    """`tree` with every array leaf a ``jax.ShapeDtypeStruct`` on `target`'s compile-only
    device: what a jitted function lowers for that GPU."""
    sharding = _sharding(target)
    return jax.tree_util.tree_map(lambda x: _abstract(x, sharding), tree)


def compile_lowered(
    lowered: Any, gemm: str = "cublas", options: dict[str, Any] | None = None
) -> Any:
    """XLA's compile of `lowered` (lowered for a GPU target) on the `gemm` path."""
    if gemm not in _GEMM_OPTIONS:
        raise ValueError(f"gemm must be one of {sorted(_GEMM_OPTIONS)}, got {gemm!r}.")
    merged = {**_GEMM_OPTIONS[gemm], **(options or {})}
    return lowered.compile(compiler_options=merged or None)


# -- reading the optimized HLO -------------------------------------------------------------


def _kind(ins: _Instr, comps: dict[str, _Computation]) -> tuple[str, tuple[str, ...]]:
    """The kernel's kind and, for a gemm, its operands' element types."""
    attrs = ins.attrs
    if ins.opcode == "custom-call":
        found = re.search(r'custom_call_target="([^"]+)"', attrs)
        target = found.group(1) if found else "?"
        if target.startswith("__cublas"):
            return "gemm", ()
        if target.startswith("__cudnn$conv"):
            return "conv", ()
        if target.startswith("__cudnn$fmha"):  # cuDNN's fused attention, forward or backward
            return "attention", ()
        if target.startswith("__cudnn$blockScaledDot"):  # MXFP8/NVFP4: a gemm scaling blocks
            return "gemm", ()
        return "custom-call", ()
    if ins.opcode == "fusion":
        called = _called(attrs)
        fusion_kind = re.search(r"kind=(k\w+)", attrs)
        kind = fusion_kind.group(1) if fusion_kind else "?"
        if kind == "kCustom":
            backend = re.search(r'"kind":"([^"]+)"', attrs)
            name = backend.group(1) if backend else "?"
            dot = _find(comps, called, "dot")
            if dot is not None:
                scope = [c for c in comps if dot.name in comps[c].shapes]
                types = tuple(_dtype_of(comps, scope, o) for o in dot.operands[:2])
                return "gemm", types
            if _find(comps, called, "convolution") is not None:
                return "conv", ()
            return ("softmax" if name == "__triton" else "custom-fusion"), ()
        if kind == "kOutput":  # a TPU matmul (a convolution or dot) and what fuses into it
            mm = _find(comps, called, "convolution") or _find(comps, called, "dot")
            if mm is not None:
                scope = [c for c in comps if mm.name in comps[c].shapes]
                return "gemm", tuple(_dtype_of(comps, scope, o) for o in mm.operands[:2])
        if _find(comps, called, "reduce") is not None or _find(comps, called, "reduce-window"):
            return "reduction", ()
        if kind == "kInput" and _find(comps, called, "transpose") is not None:
            return "copy/transpose", ()
        return ("loop" if kind in ("kLoop", "kInput") else kind.lower().lstrip("k")), ()
    if ins.opcode in ("dot",):
        return "gemm", ()
    if ins.opcode in ("convolution",):
        return "conv", ()
    if ins.opcode in ("reduce", "reduce-window"):
        return "reduction", ()
    if ins.opcode in ("copy", "transpose") or ins.opcode in _DMA:
        return "copy/transpose", ()
    base = ins.opcode.removesuffix("-start")
    if base in _COLLECTIVES:
        return "collective", ()
    return ins.opcode, ()


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A GPU's roofline: each kernel takes the longer of its gemm (or convolution) FLOPs at
    the peak for its operand dtype and its bytes at the memory bandwidth, plus a launch cost.
    A convolution runs at the half peak.

    Attributes:
      half: dense bfloat16/float16 gemm FLOP/s.
      fp8: dense FP8 gemm FLOP/s (gemms whose operands are all float8).
      f32: float32 (TF32) gemm FLOP/s.
      bandwidth: memory bytes per second.
      launch: seconds per kernel launch.
      fp4: dense FP4 gemm FLOP/s (NVFP4's E2M1 operands; 0 where no gemm takes them).
    """

    half: float
    fp8: float
    f32: float
    bandwidth: float
    launch: float
    fp4: float = 0.0

    def seconds(self, kernel: Kernel) -> float:
        """The kernel's modeled time."""
        types = kernel.gemm_dtypes
        peak = self.half
        if types and all(t.startswith("f8") for t in types):
            peak = self.fp8
        elif types and self.fp4 and all(t.startswith(("f8", "f4")) for t in types):
            peak = self.fp4
        elif "f32" in types:
            peak = self.f32
        return max(kernel.flops / peak, kernel.bytes / self.bandwidth) + self.launch


ROOFLINES = {
    # Measured, not nominal: bf16 gemms at 629-723 TFLOP/s on an H200 at 8192^3 (RESULTS.md's
    # GPU section), FP8 twice that, TF32 half; 2.8 TB/s of the H100 SXM's 3.35 nominal. With
    # these the model reproduced the H200's measured ratios between steps within about 3
    # points. For comparing variants of one step, not a clock (-20%..+8% on the H200).
    "h100": Roofline(700e12, 1400e12, 350e12, 2.8e12, 2.5e-6),
    # The H200's own measurements (RESULTS.md's GPU section): bf16 gemms 663.5 TFLOP/s at
    # 8192^3, TF32 366.7, a device copy 3.67 TB/s; FP8 taken as twice bf16 (not measured).
    "h200": Roofline(663.5e12, 1327e12, 366.7e12, 3.67e12, 2.5e-6),
    # The B200's nominal dense peaks (2.25 PFLOP/s bf16, 4.5 FP8, 9 FP4, 1.1 TF32) and 8 TB/s
    # at the fractions the H200 measured of its own (0.71 of the bf16 peak, 0.84 of the
    # bandwidth): no B200 measurement has checked it yet.
    "b200": Roofline(1600e12, 3200e12, 800e12, 6.7e12, 2.5e-6, fp4=6400e12),
}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel the compiled program launches.

    Attributes:
      name: the HLO instruction's name.
      kind: gemm, conv, attention (cuDNN's fused attention), loop, reduction, softmax (a
        Triton fusion), copy/transpose, collective, or the instruction's opcode.
      bytes: the bytes it reads and writes: its operands and results (a library call's
        workspace left out), as if each were read and written once.
      gemm_dtypes: a gemm's operand element types (``("bf16", "bf16")``), a fused
        attention's query and key types, else ().
      loop: the while loop or call it runs in, if any ("" at the top level).
      op_name: the JAX op it was compiled from (the instruction's ``op_name`` metadata, as
        the audit names matmuls), or "".
      flops: a gemm's FLOPs (2 * result elements * contracted size), a cuDNN
        convolution's (2 * output elements * window * input features / groups), a fused
        attention's (its matmuls', from its shapes), else 0.
      on_chip: on a TPU, the bytes of its operands and results that a core keeps in its own
        memory (VMEM), which `bytes` leaves out; 0 on a GPU.
      dma: whether it is a TPU's DMA between HBM and a core's memory (its `bytes` are what
        it brings), which a program keeping nothing on chip would not run.
    """

    name: str
    kind: str
    bytes: int
    gemm_dtypes: tuple[str, ...] = ()
    loop: str = ""
    op_name: str = ""
    flops: float = 0.0
    on_chip: int = 0
    dma: bool = False


def read_kernels(text: str) -> list[Kernel]:
    """The kernels of optimized GPU HLO `text` that its entry computation launches, through
    calls, loops and conditionals (each body once)."""
    comps = _parse(text)
    entry = next((n for n, c in comps.items() if c.entry), None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    found: list[Kernel] = []

    def walk(name: str, via: str, depth: int) -> None:
        comp = comps[name]
        for ins in comp.instrs:
            if ins.opcode in _FREE or ins.opcode.endswith("-done"):
                continue
            if ins.opcode in _CONTROL and depth < 16:
                for c in _called(ins.attrs):
                    if c in comps:
                        walk(c, via or ins.name, depth + 1)
                continue
            kind, types = _kind(ins, comps)
            if kind in ("gemm", "attention") and not types:
                types = tuple(
                    (_arrays(comp.shapes.get(o, "")) or [("?", ())])[0][0] for o in ins.operands[:2]
                )
            library = ins.opcode == "custom-call"
            if library and re.search(r'custom_call_target="\w*Bitcast"', ins.attrs):
                continue  # a TPU's concatenation in place: no data moves
            on_chip, dma = 0, ins.opcode in _DMA
            if dma:
                moved = _bytes(ins.shape, on_chip=True)
            else:
                hbm, on_chip = (
                    _bytes(ins.shape, library, chip)
                    + sum(_bytes(comp.shapes.get(o, ""), on_chip=chip) for o in ins.operands)
                    for chip in (False, True)
                )
                moved = hbm
                if kind == "collective":  # its bytes cross the interconnect from either memory
                    moved, on_chip = hbm + on_chip, 0
                if ins.opcode == "fusion":
                    moved -= _in_place_saving(ins, comps)
            op = re.search(r'op_name="([^"]*)"', ins.attrs)
            name = op.group(1) if op else ""
            flops = _flops(kind, ins, comp, comps)
            found.append(Kernel(ins.name, kind, moved, types, via, name, flops, on_chip, dma))

    walk(entry, "", 0)
    return found


def _in_place_saving(ins: _Instr, comps: dict[str, _Computation]) -> int:
    """Bytes a fusion does not move although its operands and results count them: each
    buffer it updates in place (a dynamic-update-slice of one of its parameters, which XLA
    gives the result's buffer) is neither read nor written whole, only the update written.
    XLA's own cost analysis counts such a fusion the same way."""
    called = _called(ins.attrs)
    if not called or called[0] not in comps:
        return 0
    body = comps[called[0]]
    params = {i.name for i in body.instrs if i.opcode == "parameter"}
    saved = 0
    for dus in body.instrs:
        if dus.opcode != "dynamic-update-slice" or len(dus.operands) < 2:
            continue
        if dus.operands[0] not in params:
            continue
        full = _bytes(dus.shape)
        if not full:
            continue  # a buffer in a core's own memory: not counted anyway
        update = _arrays(body.shapes.get(dus.operands[1], ""))
        written = sum(math.prod(d) * _element_bits(t) // 8 for t, d in update)
        saved += 2 * full - written
    return max(saved, 0)


def narrowing_pairs(text: str) -> int:
    """How many ``convert(convert(x: wide) -> narrow) -> wide`` pairs HLO `text` holds (the
    rounding a program asks for with ``x.astype(bf16).astype(f32)``)."""
    count = 0
    for comp in _parse(text).values():
        by_name = {i.name: i for i in comp.instrs}
        for ins in comp.instrs:
            if ins.opcode != "convert" or not ins.operands:
                continue
            inner = by_name.get(ins.operands[0])
            if inner is None or inner.opcode != "convert" or not inner.operands:
                continue
            wide, mid = _arrays(ins.shape), _arrays(inner.shape)
            src = _arrays(comp.shapes.get(inner.operands[0], ""))
            if not (wide and mid and src):
                continue
            w, m, s = wide[0][0], mid[0][0], src[0][0]
            if w in _FLOATS and s in _FLOATS and m in _FLOATS and w == s:
                if _element_bits(m) < _element_bits(w):
                    count += 1
    return count


@dataclasses.dataclass(frozen=True)
class GpuProgram:
    """The program XLA compiled for a GPU target: what :func:`mpjax.audit` shows with
    ``target=``.

    Attributes:
      target: the target's name ("h100") or "custom".
      gemm: the gemm path compiled ("cublas": every matmul a cuBLAS call; "triton": XLA's
        default, with untuned tiles on a machine without the GPU).
      kernels: every kernel launched (see :class:`Kernel`).
      temp_bytes: the compiled program's temporary memory, from ``memory_analysis()``.
      narrowing_casts: narrow-then-widen cast pairs in the program before XLA's passes.
      folded_casts: how many of those the optimized program no longer has: the rounding
        they asked for is gone (on GPUs XLA folds ``x.astype(bf16).astype(f32)`` to ``x``,
        openxla/xla#41605).
    """

    target: str
    gemm: str
    kernels: tuple[Kernel, ...]
    temp_bytes: int
    narrowing_casts: int = 0
    folded_casts: int = 0

    @property
    def bytes_moved(self) -> int:
        """The bytes every kernel reads and writes, summed."""
        return sum(k.bytes for k in self.kernels)

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """{kind: (kernels, bytes moved)}, the most bytes first."""
        acc: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for k in self.kernels:
            acc[k.kind][0] += 1
            acc[k.kind][1] += k.bytes
        return {k: (v[0], v[1]) for k, v in sorted(acc.items(), key=lambda kv: -kv[1][1])}

    def modeled_seconds(self, roofline: Roofline | None = None) -> float:
        """The step's time by the target's roofline (see :class:`Roofline`): the sum over its
        kernels of the longer of their gemm FLOPs at the peak and their bytes at the
        bandwidth, plus a launch each. For comparing variants of one step."""
        line = roofline or self.roofline()
        return sum(line.seconds(k) for k in self.kernels)

    def gemm_dtypes(self) -> dict[str, int]:
        """{"bf16 x bf16": gemms, ...}: what the gemms run in."""
        return dict(
            collections.Counter(" x ".join(k.gemm_dtypes) for k in self.kernels if k.kind == "gemm")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "gemm": self.gemm,
            "kernels": len(self.kernels),
            "bytes_moved": self.bytes_moved,
            "by_kind": {k: {"kernels": n, "bytes": b} for k, (n, b) in self.by_kind().items()},
            "gemm_dtypes": self.gemm_dtypes(),
            "temp_bytes": self.temp_bytes,
            "narrowing_casts": self.narrowing_casts,
            "folded_casts": self.folded_casts,
            "modeled_seconds": self.modeled_seconds(),
            "modeled_seconds_by_kind": self.modeled_by_kind(),
        }

    def modeled_by_kind(self, roofline: Roofline | None = None) -> dict[str, float]:
        """{kind: modeled seconds} (see :meth:`modeled_seconds`), the longest first."""
        line = roofline or self.roofline()
        acc: dict[str, float] = collections.defaultdict(float)
        for k in self.kernels:
            acc[k.kind] += line.seconds(k)
        return dict(sorted(acc.items(), key=lambda kv: -kv[1]))

    def roofline(self) -> Roofline:
        """The target's roofline (an H100's for a custom target)."""
        return ROOFLINES.get(self.target, ROOFLINES["h100"])

    def __str__(self) -> str:
        rows = [
            f"{self.target} program ({self.gemm} gemms): {len(self.kernels)} kernels, "
            f"{self.bytes_moved / 2**20:.1f} MiB moved, temp {self.temp_bytes / 2**20:.1f} MiB",
            f"  modeled time {self.modeled_seconds() * 1e3:.3f} ms (a roofline over the kernels)",
            f"  {'kind':<16}{'kernels':>8}{'MiB':>10}{'modeled ms':>12}",
        ]
        times = self.modeled_by_kind()
        rows += [
            f"  {k:<16}{n:>8}{b / 2**20:>10.1f}{times[k] * 1e3:>12.3f}"
            for k, (n, b) in self.by_kind().items()
        ]
        rows.append(
            "  gemms: " + ", ".join(f"{n} {d}" for d, n in sorted(self.gemm_dtypes().items()))
        )
        fused = collections.Counter(
            " x ".join(k.gemm_dtypes) for k in self.kernels if k.kind == "attention"
        )
        if fused:
            rows.append(
                "  fused attention (cuDNN): "
                + ", ".join(f"{n} {d}" for d, n in sorted(fused.items()))
            )
        if self.folded_casts:
            rows.append(
                f"  {self.folded_casts} of {self.narrowing_casts} narrowing cast pairs "
                "(x.astype(half).astype(float32)) folded away: their rounding does not happen"
            )
        return "\n".join(rows)


def read_program(lowered: Any, compiled: Any, text: str, target: str, gemm: str) -> GpuProgram:
    """The :class:`GpuProgram` of a lowering, its GPU compile and that compile's text."""
    try:
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a backend without memory analysis
        temp = -1
    before = narrowing_pairs(lowered.as_text(dialect="hlo"))
    after = narrowing_pairs(text)
    return GpuProgram(
        target_name(target) if target_name(target) in TARGETS else "custom",
        gemm,
        tuple(read_kernels(text)),
        temp,
        before,
        max(0, before - after),
    )
