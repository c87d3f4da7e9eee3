"""FP8 for any JAX function: dot_general in float8 (HYBRID), delayed or current scaling.

Import it explicitly (``import mpjax.fp8``); ``import mpjax`` does not load it.
"""

from mpjax._src.fp8 import (
    CurrentScaling,
    DelayedScaling,
    FP8Policy,
    FP8State,
    apply,
    describe,
    fp8_dot_general,
    fp8_max,
    init,
    merge,
    policy,
    qdq,
    update,
    value_and_grad,
)

__all__ = (
    "CurrentScaling",
    "DelayedScaling",
    "FP8Policy",
    "FP8State",
    "apply",
    "describe",
    "fp8_dot_general",
    "fp8_max",
    "init",
    "merge",
    "policy",
    "qdq",
    "update",
    "value_and_grad",
)
