"""Hardware advice: warn once when a half-precision policy meets a backend without fast half
math (PaddlePaddle does the same); never fail."""

from __future__ import annotations

import contextlib
import contextvars
import re
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from mpjax._src.policy import Policy


class HardwareWarning(UserWarning):
    """A half-precision policy on a backend that has no fast half-precision math.

    Example:
      >>> import warnings, mpjax
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore", mpjax.HardwareWarning)  # e.g. in CPU-only tests
      ...     f = mpjax.autocast(lambda x: x, mpjax.Policy.from_level("O2", "bfloat16"))"""


_warned: set[tuple[str, str]] = set()
# The first NVIDIA compute capability with fast math for each dtype (tensor cores).
_MIN_CAPABILITY = {"float16": 7.0, "bfloat16": 8.0}


def advice(policy: Policy) -> str | None:
    """Returns why `policy`'s half dtype is slow on the default backend, or None if it is fast.

    Example:
      >>> import mpjax
      >>> mpjax.hardware_advice(mpjax.Policy.from_level("O0")) is None
      True
    """
    if not policy.half:
        return None
    dtype = np.dtype(policy.compute_dtype).name
    device = jax.devices()[0]
    platform = device.platform
    if platform == "tpu":
        return (
            None
            if dtype == "bfloat16"
            else (
                "float16 on TPU has no fast path (TPUs compute in bfloat16); use "
                "Policy.from_level(level, 'bfloat16')."
            )
        )
    if platform == "gpu":
        cc = _capability(device)
        if cc is None or cc >= _MIN_CAPABILITY[dtype]:
            return None
        return (
            f"{dtype} needs NVIDIA compute capability >= {_MIN_CAPABILITY[dtype]} for tensor "
            f"cores; this GPU ({device.device_kind}) has {cc}, so half precision saves memory "
            "but not time"
            + (". Try float16." if dtype == "bfloat16" and cc >= 7.0 else ". Use O0 for speed.")
        )
    return (
        f"{dtype} compute on {platform}: this backend has no fast half-precision math, so the "
        "policy saves memory but runs slower than float32; use O0 here, or a GPU (compute "
        "capability >= 7.0 for float16, >= 8.0 for bfloat16) or a TPU (bfloat16)."
    )


def _capability(device: Any) -> float | None:
    """A GPU device's NVIDIA compute capability as a number (9.0), or None if it has none."""
    capability = getattr(device, "compute_capability", None)
    try:
        return float(capability) if capability is not None else None
    except (TypeError, ValueError):
        return None


def warn_if_slow(policy: Policy) -> None:
    """Warns once per backend and dtype if `policy` computes in half where that is slow."""
    if not policy.half:
        return
    key = (jax.default_backend(), np.dtype(policy.compute_dtype).name)
    if key in _warned:
        return
    message = advice(policy)
    _warned.add(key)
    if message:
        warnings.warn(f"mpjax: {message}", HardwareWarning, stacklevel=3)


# The GPU a program is being traced for when it is compiled for a target rather than for the
# machine's own device (mpjax.audit(..., target=...)): its GpuTargetConfig text.
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("mpjax_target", default=None)


@contextlib.contextmanager
def tracing_for(target_config: str | None) -> Iterator[None]:
    """Programs traced inside are for the GPU `target_config` describes (a GpuTargetConfig
    text proto), not for this machine's devices."""
    token = _TARGET.set(target_config)
    try:
        yield
    finally:
        _TARGET.reset(token)


def traced_capability() -> float | None:
    """The compute capability (9.0) of the NVIDIA GPU a program is being traced for: the
    target being compiled for (see tracing_for), else this machine's first device; None
    where that is no NVIDIA GPU."""
    config = _TARGET.get()
    if config is not None:
        found = re.search(
            r"cuda_compute_capability\s*\{\s*major:\s*(\d+)(?:\s*minor:\s*(\d+))?", config
        )
        if found is None:
            return None
        return float(f"{found.group(1)}.{found.group(2) or 0}")
    device = jax.devices()[0]
    return _capability(device) if device.platform == "gpu" else None


def block_scaled_gemms() -> bool:
    """Whether the GPU a program is being traced for has tensor cores that scale blocks
    (compute capability 10 or more: Blackwell), so MXFP8 gemms run as cuDNN block-scaled
    dots: the target being compiled for (see tracing_for), else this machine's first device."""
    cc = traced_capability()
    return cc is not None and cc >= 10


def fp8_kernels() -> bool:
    """Whether the GPU a program is being traced for writes float8 from its own kernels
    (Triton's, compute capability 8.9 or more: Ada, Hopper, Blackwell)."""
    cc = traced_capability()
    return cc is not None and cc >= 8.9


def one_device() -> bool:
    """Whether the program being traced runs on one device: a compile-only target (one GPU),
    or a machine with one device. FP8's quantizing Pallas kernels run only then: XLA's SPMD
    partitioner does not split a Pallas call, so under sharding it would gather the call's
    operands whole onto every device."""
    return _TARGET.get() is not None or jax.device_count() == 1
