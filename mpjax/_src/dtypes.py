"""Dtype tests that several modules share: one name for each question."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def is_float_dtype(dtype: Any) -> bool:
    """Whether `dtype` is a real floating dtype (float8 to float64)."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def is_float(x: Any) -> bool:
    """Whether `x` (an array, tracer or aval) has a real floating dtype."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and is_float_dtype(dtype)


def is_inexact(x: Any) -> bool:
    """Whether `x` has a floating or complex dtype (a leaf a loss scale multiplies)."""
    return hasattr(x, "dtype") and bool(jnp.issubdtype(x.dtype, jnp.inexact))


def is_half(x: Any) -> bool:
    """Whether `x` is float16 or bfloat16."""
    return hasattr(x, "dtype") and np.dtype(x.dtype) in HALF_DTYPES


def max_exponent(dtype: Any) -> int:
    """The exponent of the floating `dtype`'s range: 2**max_exponent is beyond it."""
    return int(jnp.finfo(dtype).maxexp)


def dtype_max(dtype: Any) -> float:
    """The largest finite value of the floating `dtype`."""
    return float(jnp.finfo(dtype).max)
