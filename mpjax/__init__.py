"""mpjax: functional mixed-precision training for JAX and Flax.

Precision policies and the O0-O3 levels, loss scales as pytrees, and loss scaling as an optax
transformation. ``import mpjax as jmp`` works: jmp's public names behave as jmp's.
"""

from mpjax._src.hardware import HardwareWarning
from mpjax._src.hardware import advice as hardware_advice
from mpjax._src.interpreter.autocast_api import autocast
from mpjax._src.interpreter.first_order import UntouchedWarning
from mpjax._src.interpreter.ops import F32_OPS, LOWER_OPS
from mpjax._src.interpreter.regions import full_precision, half_precision
from mpjax._src.levels import LEVELS
from mpjax._src.optim.half_params import HalfUpdatesState, half_updates, stochastic_round
from mpjax._src.optim.quantized_state import (
    QuantizedMoment,
    QuantizedMomentsState,
    quantize_moments,
)
from mpjax._src.policy import (
    Policy,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
    parse_dtype,
)
from mpjax._src.scaling.gradients import accumulate_gradients, all_reduce_gradients
from mpjax._src.scaling.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from mpjax._src.scaling.transform import (
    HalfAdamWarning,
    InexactSkipWarning,
    LossScaleState,
    NonFiniteLeaves,
    get_loss_scale,
    loss_scale,
    loss_scale_metrics,
    nonfinite_leaves,
    scaled_value_and_grad,
)
from mpjax._src.scaling.transform import (
    value_and_grad as value_and_grad,  # renamed: warns, one release
)
from mpjax._src.tools.audit import audit
from mpjax._src.tools.audit_report import AuditReport
from mpjax._src.tools.compare import compare
from mpjax._src.tools.compare_report import CompareReport
from mpjax._src.tools.f32_search import F32Rules, find_f32_rules
from mpjax._src.tools.nonfinite import NonFiniteOrigin, find_nonfinite
from mpjax._src.tools.tpu_program import mesh as target_mesh

__version__ = "0.1.0"

from mpjax._src import jmp_alias as _jmp_alias  # noqa: E402

_jmp_alias.install()  # `from jmp._src import ...` under `sys.modules["jmp"] = mpjax`

_SUBMODULES = ("flax", "fp8", "export", "checkpoint")


def __getattr__(name: str):  # submodules load on first use: `import mpjax` stays light
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"mpjax.{name}")
    raise AttributeError(f"module 'mpjax' has no attribute {name!r}")


__all__ = (  # sorted
    "accumulate_gradients",
    "all_finite",
    "all_reduce_gradients",
    "audit",
    "AuditReport",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "compare",
    "CompareReport",
    "DynamicLossScale",
    "F32_OPS",
    "F32Rules",
    "find_f32_rules",
    "find_nonfinite",
    "full_precision",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "half_precision",
    "half_updates",
    "HalfAdamWarning",
    "HalfUpdatesState",
    "hardware_advice",
    "HardwareWarning",
    "InexactSkipWarning",
    "LEVELS",
    "loss_scale",
    "loss_scale_metrics",
    "LossScale",
    "LossScaleState",
    "LOWER_OPS",
    "nonfinite_leaves",
    "NonFiniteLeaves",
    "NonFiniteOrigin",
    "NoOpLossScale",
    "parse_dtype",
    "Policy",
    "quantize_moments",
    "QuantizedMoment",
    "QuantizedMomentsState",
    "scaled_value_and_grad",
    "select_tree",
    "StaticLossScale",
    "stochastic_round",
    "target_mesh",
    "UntouchedWarning",
)
