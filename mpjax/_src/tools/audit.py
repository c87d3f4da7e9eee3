"""What ran in which precision: `audit` walks a function's lowered StableHLO module through
the MLIR Python bindings (and reads the backend's optimized HLO text), and reports its
matmuls, converts and half-precision risks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from mpjax._src import hardware
from mpjax._src.interpreter.autocast_api import flat_call
from mpjax._src.interpreter.values import is_dynamic
from mpjax._src.tools import gpu_program, tpu_program
from mpjax._src.tools.audit_hlo import compile_text, parse_compiled, partitioned_collectives
from mpjax._src.tools.audit_report import AuditReport
from mpjax._src.tools.audit_stablehlo import read_module


def _lower(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """`fn` lowered at `args` and `kwargs`: by its own ``lower`` where that gives JAX's
    ``Lowered``, else by a jit of `fn` over the array leaves, the other leaves static."""
    if hasattr(fn, "lower"):
        # A jitted function's own lowering keeps what only a top-level jit may carry
        # (compiler_options, donation, static_argnums); nested in another jit, JAX rejects it.
        try:
            own = fn.lower(*args, **kwargs)
        except TypeError:  # a leaf jax.jit takes for no array (a module's activation function)
            own = None
        if hasattr(own, "compiler_ir"):  # eqx.filter_jit's own Lowered has none
            return own
    # Split as autocast splits them: arrays (and shape structs standing for arrays) are the
    # program's inputs; any other leaf is static, baked into the trace.
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [
        i for i, x in enumerate(leaves) if is_dynamic(x) or isinstance(x, jax.ShapeDtypeStruct)
    ]

    flat = flat_call(fn, leaves, treedef, dynamic)
    flat.__name__ = getattr(fn, "__name__", type(fn).__name__)  # ops still read jit(<name>)/
    return jax.jit(flat).lower(*[leaves[i] for i in dynamic])


def audit(
    fn: Callable[..., Any],
    *args: Any,
    compile: bool = True,
    target: str | None = None,
    gemm: str = "cublas",
    **kwargs: Any,
) -> AuditReport:
    """Reports what `fn` runs in which precision, read from its lowered program.

    Lowers ``fn(*args, **kwargs)`` (jitted or not) to StableHLO and walks the module through
    the MLIR Python bindings (its text changes between JAX releases; its structure does not):
    loop, conditional and collective regions in place, and each called function's body at its
    call. It lists every dot_general and convolution with operand and result dtypes, shapes,
    FLOPs and source location; counts converts; flags float32-list ops (exp, log, rsqrt,
    sums, ...) that run in half; and advises on half matmuls not aligned to 8 (tensor cores).
    A matmul whose operands are dequantized from float8 right before it (as ``mpjax.fp8``
    runs its sites) counts as FP8: ``report.fp8_matmuls`` and ``report.fp8_flop_share``.
    With `compile`, it also reads the backend's optimized HLO (text, the only form XLA gives)
    to show the dtypes the matmuls really run in.

    With `target` (``"h100"``, ``"h200"``, ``"b200"``, or a GpuTargetConfig text proto),
    it compiles the program XLA would run on that GPU, from any machine, CPU-only ones
    included (JAX's CUDA plugin must be installed; no GPU or NVIDIA library is needed), and
    ``report.gpu`` lists its kernels by kind, the bytes they move, its gemms' dtypes (half,
    float32, FP8), its temp memory, the narrowing casts XLA folded away and the step's
    modeled time (a roofline over its kernels, ``report.gpu.modeled_seconds()``). With a TPU
    target (``"tpu-v5e"``, ``"tpu-v5p"``, ``"tpu-v6e"``, or a slice as ``"tpu-v5e:2x4"``,
    libtpu installed: ``pip install "jax[tpu]==<your jax>"``), ``report.tpu`` shows the TPU's
    program the same way: its fusions, HBM bytes, matmul dtypes, temp memory and modeled
    time; arguments sharded over :func:`mpjax.target_mesh` show a sliced step's collectives.

    It takes anything :func:`mpjax.autocast` accepts: `fn` plain, jitted (``jax.jit``,
    ``eqx.filter_jit``) or autocast, its arguments pytrees whose array leaves (or
    ``jax.ShapeDtypeStruct``) are the program's inputs. Any other leaf (an equinox module's
    activation function, a Python number, a string) is static: baked into the program, as
    jax.jit's static arguments are.

    The table's "where" column is the op's source line (``model.py:12``). Where the op's name
    stack holds a module path (Flax linen's, equinox's, a ``jax.named_scope``), the path comes
    first: ``Net/Dense_0 (linear.py:287)``, since every Dense runs Flax's same line. An NNX
    model run through :func:`mpjax.flax.wrap` is named the same way (``Net/blocks_0/fc``);
    NNX itself records no path, so an unwrapped NNX model's rows show the line alone.

    Args:
      fn: the function, e.g. a jitted train step.
      *args: its arguments: pytrees of arrays or ``jax.ShapeDtypeStruct``, and static leaves.
      compile: also compile and read the optimized HLO (default True).
      target: an accelerator to compile for instead of this machine's backend: "h100",
        "h200", "b200" (in any case) or a GpuTargetConfig text proto; "tpu-v5e", "tpu-v5p",
        "tpu-v6e" or a slice ("tpu-v6e:4x4"). The arguments' arrays stand for arrays there
        (replicated, unless they carry a sharding over :func:`mpjax.target_mesh`).
      gemm: with `target`: "cublas" (default; every matmul a cuBLAS call, as no autotuning
        runs without the GPU) or "triton" (XLA's default path, untuned tiles).
      **kwargs: its keyword arguments.

    Returns:
      An :class:`AuditReport`.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> def f(w, x):  # all in float16 by hand, softmax's exp included
      ...     return jax.nn.softmax(x.astype(jnp.float16) @ w.astype(jnp.float16))
      >>> report = mpjax.audit(f, jnp.ones((16, 8)), jnp.ones((4, 16)))
      >>> report.half_flop_share, [r.op for r in report.risks]
      (1.0, ['exp'])
      >>> layer = lambda w, x, act: act(x @ w)  # act, a function, is a static leaf
      >>> len(mpjax.audit(layer, jnp.ones((16, 8)), jnp.ones((4, 16)), jax.nn.relu).matmuls)
      1

      Under ``mpjax.autocast(f, mpjax.Policy.from_level("O1", "float16"))`` the matmul stays
      in float16 and the exp runs in float32, so ``report.risks`` is empty.
    """
    if not callable(fn):
        raise TypeError(f"audit needs a function, got {type(fn).__name__}.")
    program = tpu = None
    on_tpu = target is not None and tpu_program.is_tpu(target)
    if target is not None and on_tpu:  # the arguments stand for arrays on that TPU's chips
        args, kwargs = tpu_program.on_target((args, kwargs), target)
    elif target is not None:  # on that GPU
        args, kwargs = gpu_program.on_target((args, kwargs), target)
    config = None if target is None or on_tpu else gpu_program.target_config(target)
    with hardware.tracing_for(config):
        lowered = _lower(fn, args, kwargs)
    found = read_module(lowered.compiler_ir("stablehlo"))
    compiled = None
    if target is not None:
        if on_tpu:
            binary = lowered.compile()
            text = binary.as_text()
            tpu = tpu_program.read_program(lowered, binary, text, target)
        else:
            binary = gpu_program.compile_lowered(lowered, gemm)
            text = binary.as_text()
            program = gpu_program.read_program(lowered, binary, text, target, gemm)
        compiled_matmuls, inserted = parse_compiled(text)
        compiled = tuple(compiled_matmuls)
        found.collectives += inserted
    elif compile:
        try:
            text, partitioned = compile_text(lowered)
            if text is not None:
                compiled_matmuls, inserted = parse_compiled(text)
                compiled = tuple(compiled_matmuls)
                found.collectives += inserted
            if partitioned is not None:
                found.collectives += partitioned_collectives(partitioned)
        except Exception:  # noqa: BLE001 - the report stands without the optimized HLO
            compiled = None
    return AuditReport(
        matmuls=tuple(found.matmuls),
        converts=found.converts,
        risks=tuple(found.risks),
        untouched=tuple(found.untouched),
        untouched_why=tuple(found.untouched_why),
        compiled_matmuls=compiled,
        backend=("tpu" if on_tpu else "gpu") if target is not None else jax.default_backend(),
        collectives=tuple(found.collectives),
        gpu=program,
        tpu=tpu,
    )
