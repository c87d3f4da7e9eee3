"""FP8 for any JAX function: dot_general in float8 (HYBRID), delayed or current scaling,
MXFP8 and NVFP4 blocks.

Import it explicitly (``import mpjax.fp8``); ``import mpjax`` does not load it.
"""

from mpjax._src.float8.fp8 import (
    CurrentScaling,
    DelayedScaling,
    FP8Policy,
    FP8State,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    apply,
    describe,
    init,
    merge,
    policy,
    scaled_value_and_grad,
    update,
)
from mpjax._src.float8.fp8 import fp8_max as fp8_max  # renamed: warns, one release
from mpjax._src.float8.fp8 import value_and_grad as value_and_grad  # renamed: warns, one release
from mpjax._src.float8.fp8_dot import fp8_dot_general, qdq

__all__ = (
    "apply",
    "CurrentScaling",
    "DelayedScaling",
    "describe",
    "fp8_dot_general",
    "FP8Policy",
    "FP8State",
    "init",
    "merge",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "policy",
    "qdq",
    "scaled_value_and_grad",
    "update",
)
