"""The op lists: which JAX primitives run in half, which stay in float32, which follow inputs."""

from __future__ import annotations

import enum
from collections.abc import Iterable

# Matmul-like ops that gain from tensor cores: torch.amp's CUDA "lower_precision_fp" list and
# PaddlePaddle's O1 white list, in JAX primitive names.
_LOWER = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})

# Ops that lose accuracy or overflow in half: torch.amp's CUDA "fp32" list and Paddle's O1
# black list. Softmax, log_softmax, logsumexp, norms, cross-entropy and MSE are built from these.
_F32 = frozenset(
    {
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "pow",
        "rsqrt",
        "tan",
        "sinh",
        "cosh",
        "asin",
        "acos",
        "erf_inv",
        "reduce_sum",
        "reduce_prod",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
    }
)

# Every other primitive mpjax knows by name; at O1 these follow their inputs (widest float wins).
_FOLLOW = frozenset(
    {
        "abs", "acosh", "add", "and", "argmax", "argmin", "asinh", "atan", "atan2", "atanh",
        "bessel_i0e", "bessel_i1e", "broadcast_in_dim", "cbrt", "ceil", "clamp", "concatenate",
        "convert_element_type", "copy", "cos", "cummax", "cummin", "digamma", "div",
        "dynamic_slice", "dynamic_update_slice", "eq", "erf", "erfc", "floor", "gather", "ge",
        "gt", "integer_pow", "iota", "is_finite", "le", "lgamma", "logistic", "lt", "max", "min",
        "mul", "ne", "neg", "nextafter", "not", "or", "pad", "reduce_and", "reduce_max",
        "reduce_min", "reduce_or", "reduce_precision", "reduce_window", "reduce_window_max",
        "reduce_window_min", "reduce_window_sum", "rem", "reshape", "rev", "round", "scatter",
        "scatter-add", "scatter-max", "scatter-min", "scatter-mul", "select_and_gather_add",
        "select_and_scatter_add", "select_n", "sign", "sin", "sort", "split", "sqrt", "square",
        "squeeze", "sub", "tanh", "top_k", "transpose", "xor",
        # Newer primitives: jnp.stack and jnp.tile (0.7+), unstack, cotangent sums (add_any).
        "stack", "tile", "unstack", "add_any", "scatter-sub",
    }
)  # fmt: skip

# Primitives autocast deliberately runs in their traced dtypes, with the reason: none of them
# has a half-precision kernel worth having, or they carry no floats.
_UNTOUCHED: dict[str, str] = {
    **dict.fromkeys(
        ("cholesky", "eig", "eigh", "lu", "qr", "svd", "schur", "hessenberg",
         "triangular_solve", "tridiagonal", "tridiagonal_solve", "householder_product",
         "custom_linear_solve", "lu_pivots_to_permutation"),
        "linear algebra: no half-precision kernels; runs in float32, as torch.amp's fp32 list",
    ),
    **dict.fromkeys(
        ("igamma", "igammac", "igamma_grad_a", "polygamma", "zeta", "random_gamma_grad",
         "regularized_incomplete_beta", "random_gamma"),
        "special functions: float32 series and continued fractions",
    ),
    **dict.fromkeys(
        ("fft", "complex", "real", "imag", "conj"), "complex values: never cast"
    ),
    **dict.fromkeys(
        ("psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "ragged_all_to_all",
         "axis_index", "psum_scatter", "reduce_scatter", "pbroadcast", "psum_invariant",
         "all_gather_invariant", "pgather", "psend", "precv"),
        "collectives: keep the dtype the program sends (all_reduce_gradients reduces in float32)",
    ),
    **dict.fromkeys(
        ("random_bits", "random_fold_in", "random_seed", "random_split", "random_wrap",
         "random_unwrap", "threefry2x32", "rng_bit_generator", "rng_uniform", "clz",
         "population_count", "shift_left", "shift_right_arithmetic", "shift_right_logical",
         "mulhi", "reduce_xor", "eq_to", "le_to", "lt_to"),
        "integer, bit and key arithmetic: no floats to cast",
    ),
    **dict.fromkeys(
        ("reduce", "select_and_scatter", "approx_top_k", "reduce_and_with_jaxpr",
         "argsort"),
        "a generic reduction or selection with a user body: runs as traced",
    ),
    **dict.fromkeys(
        ("after_all", "create_token", "infeed", "outfeed", "call", "stage", "get", "swap",
         "empty", "empty2", "dce_sink", "custom_lin", "xla_pmap", "zeros_like", "pure_callback",
         "io_callback", "debug_callback", "debug_print", "custom_jvp_call_jaxpr", "addupdate",
         "platform_index"),
        "tokens, effects, state and internals: nothing to cast",
    ),
}  # fmt: skip


class Kind(enum.Enum):
    """What autocast does with a primitive (see :data:`PRIMITIVES`)."""

    LOWER = "lower"  # runs in the policy's half dtype (tensor-core math)
    F32 = "f32"  # runs in float32
    FOLLOW = "follow"  # follows its inputs at O1, the policy's compute dtype at O2
    UNTOUCHED = "untouched"  # runs in its traced dtypes, for the reason given


def _table(
    groups: Iterable[tuple[Kind, Iterable[str], str]],
) -> dict[str, tuple[Kind, str]]:
    table: dict[str, tuple[Kind, str]] = {}
    for kind, names, why in groups:
        for name in names:
            if name in table:
                raise AssertionError(f"{name} is listed as {table[name][0]} and as {kind}")
            table[name] = (kind, why)
    return table


# The one table: each primitive mpjax knows by name, its kind and, for those left untouched,
# why. A primitive of the current JAX that is not in it is a test failure
# (tests/test_autocast.py), so a new JAX release cannot add one that falls out silently.
PRIMITIVES: dict[str, tuple[Kind, str]] = _table(
    [
        (Kind.LOWER, _LOWER, "matmul-like: tensor cores"),
        (Kind.F32, _F32, "loses accuracy or overflows in half"),
        (Kind.FOLLOW, _FOLLOW, "follows its inputs"),
        *((Kind.UNTOUCHED, [name], why) for name, why in _UNTOUCHED.items()),
    ]
)
LOWER_OPS: frozenset[str] = frozenset(n for n, (k, _) in PRIMITIVES.items() if k is Kind.LOWER)
F32_OPS: frozenset[str] = frozenset(n for n, (k, _) in PRIMITIVES.items() if k is Kind.F32)
FOLLOW_OPS: frozenset[str] = frozenset(n for n, (k, _) in PRIMITIVES.items() if k is Kind.FOLLOW)
UNTOUCHED_OPS: dict[str, str] = {
    n: why for n, (k, why) in PRIMITIVES.items() if k is Kind.UNTOUCHED
}
KNOWN_OPS: frozenset[str] = LOWER_OPS | F32_OPS | FOLLOW_OPS


def check_op_names(names: Iterable[str], arg_name: str) -> frozenset[str]:
    """Returns `names` as a frozenset, raising ValueError on a name that is not a known primitive.

    Args:
      names: JAX primitive names, e.g. ``{"dot_general", "exp"}``.
      arg_name: the argument the names came from, for the error message.

    Returns:
      The names as a frozenset.

    Raises:
      TypeError: if `names` is a single string rather than a collection of names.
      ValueError: if a name is not a JAX primitive that mpjax knows.
    """
    if isinstance(names, str):
        raise TypeError(
            f"{arg_name} must be a collection of primitive names, got the string {names!r}; "
            f"write {arg_name}={{{names!r}}}."
        )
    result = frozenset(names)
    unknown = sorted(n for n in result if n not in KNOWN_OPS)
    if unknown:
        hints = "; ".join(_hint(n) for n in unknown)
        raise ValueError(
            f"Unknown op name(s) {unknown} in {arg_name}: {hints}. Ops are named as JAX "
            "primitives, as jax.make_jaxpr prints them (mpjax.LOWER_OPS and mpjax.F32_OPS "
            "hold the defaults)."
        )
    return result


# What users of torch.amp, Paddle and jnp write for an op, and the primitives JAX binds for it.
_ALIASES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("matmul", "mm", "bmm", "linear", "einsum", "dot", "tensordot", "addmm", "baddbmm",
         "mul_mat", "dense"),
        ("dot_general",),
    ),
    **dict.fromkeys(
        ("conv", "conv1d", "conv2d", "conv3d", "conv_transpose", "convolution", "conv2d_transpose"),
        ("conv_general_dilated",),
    ),
    "softmax": ("exp", "reduce_sum"),
    **dict.fromkeys(
        ("log_softmax", "logsumexp", "cross_entropy", "softmax_cross_entropy"),
        ("exp", "reduce_sum", "log"),
    ),
    **dict.fromkeys(
        ("layer_norm", "layernorm", "batch_norm", "batchnorm", "group_norm", "rms_norm", "norm"),
        ("rsqrt", "reduce_sum"),
    ),
    **dict.fromkeys(("sum", "mean", "var", "std", "mse_loss"), ("reduce_sum",)),
    **dict.fromkeys(("sigmoid", "silu", "swish"), ("logistic",)),
    **dict.fromkeys(("where", "select"), ("select_n",)),
    **dict.fromkeys(("power", "pow_", "float_power"), ("pow", "integer_pow")),
    "relu": ("max",),
    "gelu": ("tanh", "erf"),
}  # fmt: skip


def _hint(name: str) -> str:
    import difflib  # only on the error path

    if name.lower() in _ALIASES:
        prims = _ALIASES[name.lower()]
        return f"{name!r} is not a primitive; JAX binds {', '.join(map(repr, prims))} for it"
    close = difflib.get_close_matches(name, sorted(KNOWN_OPS), n=3, cutoff=0.6)
    if close:
        return f"for {name!r}, did you mean {' or '.join(map(repr, close))}"
    return f"{name!r} is not a primitive mpjax knows"


def check_disjoint(lower_ops: frozenset[str], f32_ops: frozenset[str]) -> None:
    """Raises ValueError if an op is asked to run both in half and in float32."""
    both = lower_ops & f32_ops
    if both:
        raise ValueError(
            f"Ops {sorted(both)} are in both lower_ops and f32_ops; an op runs in one "
            "precision, so list it in only one of them."
        )
