"""Precision policies: `Policy`, the O0-O3 levels, jmp's policy grammar and the cast helpers."""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src import deprecations, levels
from mpjax._src.interpreter import ops
from mpjax._src.scaling import loss_scale as loss_scale_lib

T = TypeVar("T")

# jmp's name table, so that get_policy accepts exactly what jmp accepts.
_DTYPE_NAMES: dict[np.dtype, tuple[str, ...]] = {
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(jnp.float16): ("f16", "float16"),
    np.dtype(jnp.float32): ("full", "f32", "float32"),
    np.dtype(jnp.float64): ("f64", "float64"),
}
_NAME_TO_DTYPE = {name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names}
_HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
# get_policy's keys: jmp's (p, c, o, long or short), and mpjax's reduce and level.
_GRAMMAR_KEYS = {k: n for n in ("params", "compute", "output", "reduce") for k in (n, n[0])}
_GRAMMAR_KEYS["level"] = "level"
# Keras's dtype policy names (keras.mixed_precision.set_global_policy).
_KERAS_NAMES = {"MIXED_FLOAT16": np.dtype(jnp.float16), "MIXED_BFLOAT16": np.dtype(jnp.bfloat16)}


@functools.cache
def _backend_half_dtype() -> np.dtype:
    # jmp asks the device on every call; the backend cannot change within a process.
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return np.dtype(jnp.bfloat16) if on_tpu else np.dtype(jnp.float16)


def half_dtype() -> Any:
    """Returns the half-precision dtype for the default backend, as jmp does.

    bfloat16 on TPU, float16 elsewhere (GPUs and CPU). The answer is computed once per process.
    As jmp's, it is the JAX scalar type, so ``half_dtype()(2**15)`` makes a half scalar (jmp's
    README does this) and it works wherever a dtype is expected.

    Returns:
      ``jnp.bfloat16`` on TPU, else ``jnp.float16``.

    Example:
      >>> import numpy as np, mpjax
      >>> np.dtype(mpjax.half_dtype()).name in ("float16", "bfloat16")
      True
      >>> mpjax.half_dtype()(2**15).dtype == mpjax.half_dtype()
      True
    """
    return jnp.bfloat16 if _backend_half_dtype() == np.dtype(jnp.bfloat16) else jnp.float16


def parse_dtype(value: str) -> Any:
    """Parses jmp's dtype names ('full', 'half', 'f32', 'bf16', 'float16', ...) into a dtype.

    Args:
      value: a dtype name from jmp's grammar; surrounding spaces are ignored.

    Returns:
      The JAX scalar type the name stands for (``jnp.bfloat16`` for "bf16"), as jmp's: it
      works wherever a dtype is expected, and ``parse_dtype("bf16") is jnp.bfloat16``.

    Raises:
      ValueError: starting "Unknown dtype", as jmp's, for a name not in the grammar.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> mpjax.parse_dtype("bf16") is jnp.bfloat16
      True
    """
    value = value.strip()
    if value == "half":
        return half_dtype()
    try:
        return scalar_type(_NAME_TO_DTYPE[value])
    except KeyError:
        raise ValueError(
            f"Unknown dtype '{value}' must be full,half,float16,bfloat16 or a contraction "
            "thereof (jmp's words): a policy's dtypes are floating point, full (float32, f32), "
            "half (the backend's half dtype), float16 (f16) or bfloat16 (bf16)."
            + _float8_hint(value)
        ) from None


_FP8_HINT = (
    " FP8 is not a policy dtype: it needs per-tensor scales and runs only the matmuls; use "
    "mpjax.fp8.policy('O1') (dot_general in FP8, the rest bfloat16 O1) with mpjax.fp8.init "
    "and mpjax.fp8.scaled_value_and_grad."
)


def is_float8(dtype: Any) -> bool:
    """Whether `dtype` (any spelling) names a float8 type."""
    return "float8" in str(dtype) or str(dtype).startswith("f8")


def _float8_hint(dtype: Any) -> str:
    return _FP8_HINT if is_float8(dtype) else ""


def scalar_type(dtype: Any) -> Any:
    """`dtype` as JAX's scalar type (``jnp.bfloat16`` for bfloat16), the objects jmp's
    policies hold: callable, ``is``-comparable with ``jnp.float32``, and a dtype wherever one
    is expected. A dtype JAX has no scalar type for comes back as a NumPy dtype."""
    dtype = np.dtype(dtype)
    found = getattr(jnp, dtype.name, None)
    return found if found is not None and np.dtype(found) == dtype else dtype


def canonical_float_dtype(dtype: Any, arg_name: str = "dtype") -> np.dtype:
    """Returns `dtype` (a dtype, a scalar type or a name) as a floating NumPy dtype.

    Raises:
      ValueError: if the dtype is unknown or not a floating-point dtype.
    """
    if dtype is None:
        raise ValueError(f"{arg_name} is None; pass a dtype such as jnp.float32 or 'bfloat16'.")
    if isinstance(dtype, str):
        try:
            result = np.dtype(parse_dtype(dtype))
        except ValueError:
            try:
                result = np.dtype(dtype)
            except TypeError:
                raise ValueError(
                    f"Unknown dtype {dtype!r} for {arg_name}: use 'float32', 'float16', "
                    "'bfloat16' (or jmp's short names 'f32', 'f16', 'bf16', 'full', 'half')."
                ) from None
    else:
        try:
            result = np.dtype(dtype)
        except TypeError:
            raise ValueError(
                f"Unknown dtype {dtype!r} for {arg_name}: pass a floating dtype such as "
                "jnp.float32, jnp.float16 or jnp.bfloat16."
            ) from None
    if not jnp.issubdtype(result, jnp.floating):
        raise ValueError(
            f"{arg_name} must be a floating-point dtype, got {result}; mixed precision only "
            "changes float32, float16 and bfloat16 (integers and bools are never cast)."
        )
    if _float8_hint(result):
        raise ValueError(f"{arg_name} is {result}." + _FP8_HINT)
    return result


def cast_floating(tree: T, dtype: Any) -> T:
    """Casts the floating array leaves of `tree` to `dtype`; other leaves stay as they are."""

    def cast(x):
        # As jmp: only array leaves are cast; Python scalars, ints, bools, keys, None stay as-is.
        if isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


# jmp's private name for it, which public training scripts import from jmp._src.policy.
_cast_floating_to = cast_floating


_check_level = levels.check_name


_warned_bfloat16_scaling = False


def _check_reduce_dtype(policy: Policy) -> np.dtype:
    """`policy.reduce_dtype` as a dtype, or an error that names the fix."""
    dtype = policy.reduce_dtype
    if isinstance(dtype, str) or jnp.issubdtype(np.dtype(dtype), jnp.floating):
        dtype = canonical_float_dtype(dtype, "reduce_dtype")
    else:
        raise ValueError(
            f"reduce_dtype must be a floating dtype, got {np.dtype(dtype)}: gradients are "
            "summed in float32, float16 or bfloat16. Pass jnp.float32 to reduce in float32, "
            "or None for the compute dtype."
        )
    if dtype == np.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            "reduce_dtype=float64 needs 64-bit mode, which is off: JAX would silently reduce "
            "in float32. Enable it with jax.config.update('jax_enable_x64', True), or pass "
            "jnp.float32."
        )
    compute = np.dtype(policy.compute_dtype)
    if dtype in _HALF_DTYPES and dtype != compute:
        if compute in _HALF_DTYPES:
            why = f"the gradients of {compute} compute are {compute}, not {dtype}"
            fix = f"reduce_dtype={compute.name} (or None)"
        else:
            why = (
                f"{compute} compute makes {compute} gradients, and reducing them in {dtype} "
                "would only lose precision"
            )
            fix = "reduce_dtype=None, or a level that computes in half (O1, O2)"
        raise ValueError(f"reduce_dtype={dtype.name} makes no sense here: {why}. Use {fix}.")
    return dtype


def _warn_bfloat16_scaling(kind: Any) -> None:
    global _warned_bfloat16_scaling
    if _warned_bfloat16_scaling:
        return
    _warned_bfloat16_scaling = True
    # The first frame outside mpjax: Policy(...) and from_level reach here at different depths.
    frame: Any = sys._getframe(1)
    level = 2  # stacklevel 2 is our caller
    while frame is not None and frame.f_globals.get("__name__", "").startswith("mpjax."):
        frame, level = frame.f_back, level + 1
    what = "dynamic scaling" if kind == "dynamic" else f"a static scale of {kind}"
    warnings.warn(
        f"mpjax: loss_scaling={kind!r} with bfloat16 compute: bfloat16 has float32's exponent "
        f"range, so its gradients do not underflow and need no loss scaling; {what} "
        "only adds work (and skipped steps). Leave loss_scaling unset (no scaling for bfloat16) "
        "unless you mean it.",
        UserWarning,
        stacklevel=level,
    )


def check_loss_scaling(value: Any) -> str | float:
    """Validates a policy's loss-scaling choice: 'dynamic', 'none' or a positive float."""
    if isinstance(value, str):
        if value in ("dynamic", "none"):
            return value
        raise ValueError(
            f"Unknown loss_scaling {value!r}: use 'dynamic', 'none' or a positive float for a "
            "static scale (e.g. 1024.0)."
        )
    return loss_scale_lib.check_scale_value(value, "loss_scale")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A precision policy: the dtypes of params, computation and outputs, and the op lists.

    Frozen and hashable, and not a pytree, so it can be a static argument of ``jax.jit``.
    ``Policy(param_dtype, compute_dtype, output_dtype)`` is jmp's constructor; build the
    apex-style levels with :meth:`Policy.from_level` and jmp-style strings with
    :func:`get_policy`.

    Attributes:
      param_dtype: dtype params are stored in.
      compute_dtype: the half (or full) dtype computation runs in.
      output_dtype: dtype of the model's outputs.
      level: "O0".."O3" for a level policy, None for a plain (jmp-style) one.
      lower_ops: primitives run in ``compute_dtype`` (dot_general, conv, ...).
      f32_ops: primitives kept in float32 (exp, log, reductions, ...).
      keep_norm_fp32: keep normalization statistics (and BatchNorm running stats) in float32.
      loss_scaling: 'dynamic', 'none', a float (static scale), or None to derive it: dynamic
        when float32 params are computed in float16, none otherwise.
      reduce_dtype: the dtype gradients are summed in over the batch, which under sharding
        is the dtype of their all-reduce or reduce-scatter (torch FSDP2's ``reduce_dtype``).
        None (the default) means :attr:`compute_dtype`, as in the hand-written half step:
        a weight's gradient comes out of a half matmul, and a bias's, a positional table's
        or an embedding row's is summed in half. ``jnp.float32`` on request: half matmuls
        that write float32 weight gradients, and float32 sums for the rest, so their
        collectives run in float32. See :attr:`gradient_dtype` and :attr:`gather_dtype`.

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> policy = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
      >>> policy.cast_to_compute({"w": jnp.ones(2)})["w"].dtype
      dtype(bfloat16)
      >>> str(policy)
      'p=full,c=bf16,o=full'
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any
    level: str | None = None
    lower_ops: frozenset[str] = frozenset()
    f32_ops: frozenset[str] = frozenset()
    keep_norm_fp32: bool = False
    loss_scaling: str | float | None = None
    reduce_dtype: Any = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            dtype = canonical_float_dtype(getattr(self, name), name)
            object.__setattr__(self, name, scalar_type(dtype))  # jmp's objects
        if self.level is not None:
            object.__setattr__(self, "level", _check_level(self.level))
        object.__setattr__(self, "lower_ops", ops.check_op_names(self.lower_ops, "lower_ops"))
        object.__setattr__(self, "f32_ops", ops.check_op_names(self.f32_ops, "f32_ops"))
        ops.check_disjoint(self.lower_ops, self.f32_ops)
        if self.loss_scaling is not None:
            object.__setattr__(self, "loss_scaling", check_loss_scaling(self.loss_scaling))
        if self.loss_scaling not in (None, "none") and self.compute_dtype == jnp.bfloat16:
            _warn_bfloat16_scaling(self.loss_scaling)
        if self.reduce_dtype is not None:
            object.__setattr__(self, "reduce_dtype", _check_reduce_dtype(self))

    @property
    def gradient_dtype(self) -> np.dtype:
        """The dtype gradients are summed (and, under sharding, reduced) in: `reduce_dtype`,
        or `compute_dtype` when that is None.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> mpjax.Policy.from_level("O2", "bfloat16").gradient_dtype
          dtype(bfloat16)
          >>> mpjax.Policy.from_level("O2", "bfloat16", reduce_dtype=jnp.float32).gradient_dtype
          dtype('float32')
        """
        return np.dtype(self.reduce_dtype if self.reduce_dtype is not None else self.compute_dtype)

    @property
    def gather_dtype(self) -> np.dtype:
        """The dtype params are all-gathered in when they are sharded (FSDP): the compute dtype.

        Autocast casts a param where it is used, and the cast is elementwise, so it runs on
        each device's shard before the partitioner gathers it: half bytes, as the hand-written
        step that casts params with ``.astype`` before the forward pass, torch FSDP2's
        ``param_dtype`` and MaxText's bfloat16 all-gathers.
        :meth:`mpjax.AuditReport.assert_collectives_in` checks it in the compiled step.

        Example:
          >>> import mpjax
          >>> mpjax.Policy.from_level("O2", "float16").gather_dtype
          dtype('float16')
        """
        return np.dtype(self.compute_dtype)

    # -- jmp's API ---------------------------------------------------------------------------

    def cast_to_param(self, x: T) -> T:
        """Casts the floating array leaves of `x` to `param_dtype`.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> policy = mpjax.Policy.from_level("O3", "bfloat16")
          >>> p = policy.cast_to_param({"w": jnp.ones(2), "step": jnp.int32(0)})
          >>> p["w"].dtype, p["step"].dtype   # integer leaves are never cast
          (dtype(bfloat16), dtype('int32'))
        """
        return cast_floating(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Casts the floating array leaves of `x` to `compute_dtype`.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> policy = mpjax.Policy.from_level("O1", "float16")
          >>> policy.cast_to_compute(jnp.ones(2)).dtype, policy.cast_to_compute(1.0)
          (dtype('float16'), 1.0)
        """
        return cast_floating(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """Casts the floating array leaves of `x` to `output_dtype`.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> policy = mpjax.Policy.from_level("O2", "float16")
          >>> policy.cast_to_output(jnp.ones(2, jnp.float16)).dtype
          dtype('float32')
        """
        return cast_floating(x, self.output_dtype)

    def with_param_dtype(self, param_dtype: Any) -> Policy:
        """Returns a copy with `param_dtype` replaced.

        Example:
          >>> import mpjax
          >>> str(mpjax.get_policy("p=f32,c=bf16,o=f32").with_param_dtype("bfloat16"))
          'p=bf16,c=bf16,o=full'
        """
        return dataclasses.replace(self, param_dtype=param_dtype)

    def with_compute_dtype(self, compute_dtype: Any) -> Policy:
        """Returns a copy with `compute_dtype` replaced.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> str(mpjax.get_policy("full").with_compute_dtype(jnp.float16))
          'p=full,c=f16,o=full'
        """
        return dataclasses.replace(self, compute_dtype=compute_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """Returns a copy with `output_dtype` replaced.

        Example:
          >>> import jax.numpy as jnp, mpjax
          >>> str(mpjax.get_policy("p=f32,c=bf16").with_output_dtype(jnp.float32))
          'p=full,c=bf16,o=full'
        """
        return dataclasses.replace(self, output_dtype=output_dtype)

    def is_plain(self) -> bool:
        """Whether this is a jmp policy: mpjax's fields beyond jmp's three at their defaults
        (no level, no op lists, no loss-scaling or reduce dtype). Such a policy's repr and
        ``dataclasses`` fields are jmp's.

        Example:
          >>> import mpjax
          >>> mpjax.get_policy("p=f32,c=bf16,o=f32").is_plain()
          True
          >>> mpjax.Policy.from_level("O2", "bfloat16").is_plain()
          False
        """
        return all(
            getattr(self, f.name) == f.default
            for name, f in type(self).__dataclass_fields__.items()
            if name not in _JMP_FIELDS
        )

    def __repr__(self) -> str:
        shown = dataclasses.fields(self)
        return "Policy(" + ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in shown) + ")"

    def __str__(self) -> str:
        # jmp's names: float32 prints as "full".
        names = [
            _DTYPE_NAMES.get(np.dtype(d), (str(np.dtype(d)),))[0]
            for d in (self.param_dtype, self.compute_dtype, self.output_dtype)
        ]
        text = "p={},c={},o={}".format(*names)
        if self.reduce_dtype is not None:  # mpjax's keys, beyond jmp's grammar
            reduce = np.dtype(self.reduce_dtype)
            text += ",r=" + _DTYPE_NAMES.get(reduce, (str(reduce),))[0]
        if self.level is not None:  # a level's op lists and rules: not jmp's plain casts
            text += f",level={self.level}"
        return text

    # -- levels ------------------------------------------------------------------------------

    @property
    def half(self) -> bool:
        """True when the policy computes in float16 or bfloat16.

        Example:
          >>> import mpjax
          >>> mpjax.Policy.from_level("O1", "bfloat16").half, mpjax.Policy.from_level("O0").half
          (True, False)
        """
        return np.dtype(self.compute_dtype) in _HALF_DTYPES

    def loss_scale(self) -> loss_scale_lib.LossScale:
        """Returns the loss scale this policy implies.

        A ``DynamicLossScale(2**15)`` for float16 at O1/O2 (float32 params, float16 compute),
        ``NoOpLossScale`` for bfloat16, float32 and O3, or what ``loss_scaling=`` asked for.

        Example:
          >>> import mpjax
          >>> type(mpjax.Policy.from_level("O1", "float16").loss_scale()).__name__
          'DynamicLossScale'
          >>> type(mpjax.Policy.from_level("O1", "bfloat16").loss_scale()).__name__
          'NoOpLossScale'
        """
        kind = self.loss_scaling
        if kind is None:
            needs = self.compute_dtype is jnp.float16 and self.param_dtype is jnp.float32
            kind = "dynamic" if needs else "none"
        if kind == "dynamic":
            return loss_scale_lib.DynamicLossScale(np.float32(2.0**15))
        if kind == "none":
            return loss_scale_lib.NoOpLossScale()
        return loss_scale_lib.StaticLossScale(kind)

    @classmethod
    def from_level(  # noqa: PLR0913 (a level, then keyword options as apex's amp.initialize)
        cls,
        level: str,
        half_dtype: Any = None,
        *,
        lower_ops: Any = (),
        f32_ops: Any = (),
        keep_norm_fp32: bool | None = None,
        master_weights: bool | None = None,
        loss_scaling: str | float | None = None,
        reduce_dtype: Any = None,
        loss_scale: str | float | None = None,
    ) -> Policy:
        """Builds the policy of an apex/PaddlePaddle/MindSpore optimization level.

        The level names are apex's ``"O0"``-``"O3"`` (shared by Paddle and MindSpore) and
        MindSpore's ``"auto"`` (O1), in any case. Paddle's ``"OD"`` has no mpjax level and
        is refused with the reason (see the README's table of peer level names).

        ====== ============== ============================================== =========
        level  params         compute                                        output
        ====== ============== ============================================== =========
        O0     float32        float32                                        float32
        O1     float32        dot/conv in half, f32 list in float32, rest    float32
                              follows its inputs
        O2     float32 master everything in half but the f32 list and norms  float32
        O3     half           everything in half                             half
        ====== ============== ============================================== =========

        Half params, no float32 master copy: ``from_level("O2", "bfloat16",
        master_weights=False)`` is O2's compute with params stored in the half dtype (2 bytes
        each instead of 4; 6-10 bytes per param with Adam instead of 12). Round-to-nearest
        updates then stall (an update under 2**-9 of a bfloat16 weight is lost), so train
        such params through :func:`mpjax.half_updates` (stochastic rounding or a Kahan
        buffer): ``mpjax.half_updates(optax.adam(1e-3))``. With float16 params the
        gradients are float16 too, so ask for ``loss_scaling="dynamic"``: the default scales
        only float32 params. ``master_weights=True`` at O3 is the converse, apex O3 with
        float32 storage.

        Args:
          level: "O0", "O1", "O2" or "O3" (the letter O, as apex), or "auto" (MindSpore's
            name for O1); any case.
          half_dtype: "float16"/"bfloat16" (or a dtype); defaults to :func:`half_dtype`.
          lower_ops: extra primitives to run in half (removed from the float32 list).
          f32_ops: extra primitives to keep in float32 (removed from the half list).
          keep_norm_fp32: keep normalization statistics in float32 (default: True but at O3).
          master_weights: O2/O3 only: True stores float32 params, False stores half params
            (train them with :func:`mpjax.half_updates`). Default: True at O2, False at O3.
          loss_scaling: "dynamic", "none", or a positive float for a static scale (the
            :attr:`Policy.loss_scaling` field's spelling; the old keyword ``loss_scale=`` still
            works for one release and warns). Default:
            dynamic where float32 params are computed in float16 (O1, O2), none otherwise
            (bfloat16 needs no scaling; O3 has no float32 copy to protect).
          reduce_dtype: the dtype gradients are summed and reduced in (see the class
            docstring). Default: the half dtype, as the hand-written half step; float32 on
            request.

        Returns:
          The policy.

        Raises:
          TypeError: if `level` is not a string.
          ValueError: for an unknown level (the message lists the accepted names), a peer's
            level that has no mpjax equivalent (Paddle's "OD"), an unknown dtype or op name,
            or an override that means nothing at that level (apex raises likewise), e.g.
            ``master_weights`` at O1.

        Example:
          >>> import mpjax
          >>> policy = mpjax.Policy.from_level("O2", "bfloat16")
          >>> str(policy), "exp" in policy.f32_ops, policy.keep_norm_fp32
          ('p=full,c=bf16,o=full,level=O2', True, True)
          >>> mpjax.Policy.from_level("auto", "float16").level   # MindSpore's name
          'O1'
          >>> str(mpjax.Policy.from_level("O2", "bfloat16", master_weights=False))
          'p=bf16,c=bf16,o=full,level=O2'
        """
        loss_scaling = _renamed_loss_scale(loss_scaling, loss_scale)
        level = _check_level(level)
        row = levels.LEVEL_ROWS[level]
        half = (
            canonical_float_dtype(half_dtype, "half_dtype")
            if half_dtype is not None
            else _backend_half_dtype()
        )
        f32 = np.dtype(np.float32)
        _check_half_dtype(half, row)
        lower_extra = ops.check_op_names(lower_ops, "lower_ops")
        f32_extra = ops.check_op_names(f32_ops, "f32_ops")
        ops.check_disjoint(lower_extra, f32_extra)
        given = {
            "lower_ops": bool(lower_extra),
            "f32_ops": bool(f32_extra),
            "master_weights": master_weights is not None,
            "keep_norm_fp32=False": keep_norm_fp32 is False,
        }
        for what, why in row.refuses.items():
            if given[what]:
                raise ValueError(f"{what} makes no sense at {level}: {why}")
        if not row.computes_half:
            return cls(
                f32,
                f32,
                f32,
                level=level,
                keep_norm_fp32=True,
                loss_scaling=loss_scaling,
                reduce_dtype=reduce_dtype,
            )
        stores_half = master_weights is False or (row.all_half and not master_weights)
        return cls(
            half if stores_half else f32,
            half,
            half if row.all_half else f32,
            level=level,
            lower_ops=(ops.LOWER_OPS | lower_extra) - f32_extra,
            f32_ops=((ops.F32_OPS if row.f32_list else frozenset()) | f32_extra) - lower_extra,
            keep_norm_fp32=bool(row.norms_f32 if keep_norm_fp32 is None else keep_norm_fp32),
            loss_scaling=loss_scaling,
            reduce_dtype=reduce_dtype,
        )


def _check_half_dtype(half: np.dtype, row: levels.Level) -> None:
    """from_level's half dtype: float16 or bfloat16 (float32 too at a level in float32)."""
    if half not in _HALF_DTYPES and not (not row.computes_half and half == np.float32):
        raise ValueError(
            f"half_dtype must be float16 or bfloat16, got {half}; for full precision use "
            "level 'O0'." + _float8_hint(half)
        )


def _renamed_loss_scale(loss_scaling: Any, loss_scale: Any) -> Any:
    """from_level's loss_scaling=, given by its old name loss_scale= (one release, warned)."""
    if loss_scale is None:
        return loss_scaling
    if loss_scaling is not None:
        raise TypeError(
            "from_level got both loss_scaling= and loss_scale= (its old name); pass "
            "loss_scaling= only."
        )
    warnings.warn(_LOSS_SCALE_RENAMED, FutureWarning, stacklevel=3)
    return loss_scale


_LOSS_SCALE_RENAMED = deprecations.deprecate(
    "Policy.from_level(..., loss_scale=...)", "Policy.from_level(..., loss_scaling=...)"
)


_JMP_FIELDS = ("param_dtype", "compute_dtype", "output_dtype")


class _Fields:
    """`Policy.__dataclass_fields__` as ``dataclasses`` reads it from an instance: jmp's three
    fields for a policy whose other fields are at their defaults (one jmp's API makes), so that
    ``fields``, ``asdict``, ``astuple`` and ``replace`` see jmp's class; all of them for any
    other policy, and on the class itself."""

    def __init__(self, fields: dict[str, dataclasses.Field[Any]]) -> None:
        self.all = fields
        self.jmp = {name: fields[name] for name in _JMP_FIELDS}

    def __get__(self, policy: Any, owner: Any = None) -> dict[str, dataclasses.Field[Any]]:
        return self.jmp if policy is not None and policy.is_plain() else self.all


Policy.__dataclass_fields__ = _Fields(Policy.__dataclass_fields__)  # type: ignore[assignment]


def get_policy(policy_name: str) -> Policy:
    """Parses a policy from jmp's string grammar, or a level name ("O0".."O3", "auto").

    ``"c=f16"`` gives float32 params and float16 compute and output; ``"p=f16,c=bf16"`` gives
    float16 params and bfloat16 compute and output; a bare dtype (``"half"``) sets all three.
    Keys are ``p``/``params``, ``c``/``compute``, ``o``/``output``; unspecified params are
    float32, compute follows params and output follows compute; mpjax adds ``r``/``reduce``
    (:attr:`Policy.reduce_dtype`). Unlike jmp, spaces around
    ``,`` and ``=`` are allowed. Keras's ``"mixed_float16"`` and ``"mixed_bfloat16"`` give
    level O2 in that half dtype (float32 variables, half compute, float32 norms and output).

    Args:
      policy_name: the spec string.

    Returns:
      The policy (a level policy, as :meth:`Policy.from_level`, for a level name).

    Raises:
      ValueError: "Unknown dtype ..." for a bad dtype name (as jmp), or a message naming the
        bad key or part, or saying why a peer's level name (Paddle's "OD") is refused.

    Example:
      >>> import mpjax
      >>> str(mpjax.get_policy("p=f32, c=bf16"))
      'p=full,c=bf16,o=bf16'
      >>> mpjax.get_policy("auto").level
      'O1'
      >>> mpjax.get_policy("mixed_bfloat16").level, str(mpjax.get_policy("mixed_bfloat16"))
      ('O2', 'p=full,c=bf16,o=full,level=O2')
    """
    if not isinstance(policy_name, str):
        raise TypeError(
            f"get_policy takes a string such as 'p=f32,c=bf16', got "
            f"{type(policy_name).__name__}; build a Policy(...) directly from dtypes instead."
        )
    key = policy_name.strip().upper()
    if levels.names_a_level(key):
        return Policy.from_level(policy_name)
    if key in _KERAS_NAMES:
        # Keras's mixed policies: float32 variables cast to half per layer, norms upcast, the
        # output cast to float32, a LossScaleOptimizer for float16: O2.
        return Policy.from_level("O2", _KERAS_NAMES[key])
    param_dtype: np.dtype = np.dtype(np.float32)
    compute_dtype = output_dtype = reduce_dtype = level = None
    if "=" in policy_name:
        given: dict[str, Any] = {}
        for part in policy_name.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or "=" in value:
                raise ValueError(
                    f"Bad part {part.strip()!r} in {policy_name!r}: each part is key=dtype, "
                    "e.g. 'p=f32,c=bf16,o=f32'."
                )
            if key not in _GRAMMAR_KEYS:
                raise ValueError(
                    f"Unknown key '{key}' in '{policy_name}' should be 'params', 'compute', "
                    "'output' (or mpjax's 'reduce' and 'level')."
                )
            given[_GRAMMAR_KEYS[key]] = value.strip() if key == "level" else parse_dtype(value)
        param_dtype = given.get("params", param_dtype)
        compute_dtype = given.get("compute", param_dtype)
        output_dtype = given.get("output", compute_dtype)
        reduce_dtype, level = given.get("reduce"), given.get("level")
    else:
        try:
            param_dtype = compute_dtype = output_dtype = parse_dtype(policy_name)
        except ValueError as e:  # jmp's words first, then the level names jmp does not have
            raise ValueError(f"{e} A level name is accepted too: {levels.ACCEPTED}.") from None
    if level is None:
        return Policy(param_dtype, compute_dtype, output_dtype, reduce_dtype=reduce_dtype)
    return _level_with(level, param_dtype, compute_dtype, output_dtype, reduce_dtype)


def _level_with(level: str, params: Any, compute: Any, output: Any, reduce: Any) -> Policy:
    """The policy a level's str names (half params: O2 without masters)."""
    half = None if np.dtype(compute) == np.float32 else compute
    # a level whose params are half by default (O3) needs no master_weights=False to say so
    stores_half = levels.LEVEL_ROWS[levels.check_name(level)].all_half
    masters = None if np.dtype(params) == np.float32 or stores_half else False
    policy = Policy.from_level(level, half, reduce_dtype=reduce, master_weights=masters)
    same = np.dtype(policy.output_dtype) == np.dtype(output)
    return policy if same else dataclasses.replace(policy, output_dtype=output)


def cast_to_full(tree: T) -> T:
    """Casts the floating array leaves of `tree` to float32 (jmp's ``cast_to_full``).

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> mpjax.cast_to_full(jnp.ones(2, jnp.float16)).dtype
      dtype('float32')
    """
    return cast_floating(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
    """Casts the floating array leaves of `tree` to :func:`half_dtype` (jmp's ``cast_to_half``).

    Example:
      >>> import jax.numpy as jnp, mpjax
      >>> mpjax.cast_to_half(jnp.ones(2)).dtype == mpjax.half_dtype()
      True
    """
    return cast_floating(tree, half_dtype())
