"""The error metric of mpjax.compare: a half value against its float32 reference."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

METRICS = ("rms", "max")


# -- the error metric --------------------------------------------------------------------------


# An output leaf whose float32 scale is below this share of all outputs' scale is zero up to
# float32 rounding: zero in exact arithmetic (the gradient of an attention key's bias, which
# softmax ignores). Its error is measured against all outputs' scale instead of its own noise.
NOISE_SHARE = 2.0**-14


def relative_error(
    half: Any, ref: Any, metric: str | Callable[..., Any] = "rms", scale: float = 0.0
) -> float:
    """The error of `half` against the float32 reference `ref` (both arrays), as a float.

    "rms": ``||half - ref||_2 / ||ref||_2`` (the normwise relative error), "max":
    ``max|half - ref| / max|ref|``. Both are relative to the reference's scale, not to each
    element, so zeros in the reference do not blow them up. Positions where both are the same
    infinity or both NaN agree; an inf or NaN on one side only is an error of inf. A reference
    below NOISE_SHARE of `scale` (all outputs' RMS or max) is measured against `scale`; an
    all-zero reference with no scale gives the absolute error (the RMS or max of `half`).
    """
    h = np.asarray(half, np.float64)
    r = np.asarray(ref, np.float64)
    if callable(metric):
        return float(metric(h, r))
    with np.errstate(all="ignore"):
        same = (h == r) | (np.isnan(h) & np.isnan(r))
        if np.any(~same & ~(np.isfinite(h) & np.isfinite(r))):
            return math.inf
        d = np.where(same, 0.0, h - r)
        r = np.where(np.isfinite(r), r, 0.0)
        if h.size == 0:
            return 0.0
        if metric == "max":
            num, den = float(np.max(np.abs(d))), float(np.max(np.abs(r)))
        else:
            num, den = float(np.sqrt(np.mean(d * d))), float(np.sqrt(np.mean(r * r)))
    if den < NOISE_SHARE * scale:
        den = scale
    return num / den if den > 0 else num


def output_scale(refs: list[Any], metric: Any) -> float:
    """The scale (RMS, or max for "max") of all the float32 outputs' finite values; 0 for a
    metric of the user's own."""
    if callable(metric):
        return 0.0
    with np.errstate(all="ignore"):
        values = [np.asarray(r, np.float64).ravel() for r in refs]
        values = [v[np.isfinite(v)] for v in values]
        n = sum(v.size for v in values)
        if n == 0:
            return 0.0
        if metric == "max":
            scale = max(float(np.max(np.abs(v))) for v in values if v.size)
        else:
            scale = math.sqrt(sum(float(np.sum(v * v)) for v in values) / n)
    return scale


def check_metric(metric: Any) -> str | Callable[..., Any]:
    if callable(metric) or metric in METRICS:
        return metric
    raise ValueError(
        f"metric must be one of {METRICS} or a function (half, ref) -> float of two float64 "
        f"NumPy arrays, got {metric!r}; 'rms' is ||half - f32|| / ||f32||."
    )


def metric_name(metric: Any) -> str:
    return metric if isinstance(metric, str) else getattr(metric, "__name__", "custom")


METRIC_TEXT = {"rms": " (||half - f32|| / ||f32||)", "max": " (max|half - f32| / max|f32|)"}
