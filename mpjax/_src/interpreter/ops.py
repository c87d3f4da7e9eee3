"""The op table: a record per JAX primitive, its kind (runs in half, stays in float32,
follows its inputs, ...) and its traits; every list of primitives is derived from it."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import NamedTuple

from mpjax._src.interpreter import interpret


class Kind(enum.Enum):
    """What autocast does with a primitive (see :data:`PRIMITIVES`)."""

    # Matmul-like ops that gain from tensor cores: torch.amp's CUDA "lower_precision_fp" list
    # and PaddlePaddle's O1 white list.
    LOWER = "lower"  # runs in the policy's half dtype (tensor-core math)
    # Ops that lose accuracy or overflow in half: torch.amp's CUDA "fp32" list and Paddle's O1
    # black list. Softmax, log_softmax, logsumexp, norms and losses are built from these.
    F32 = "f32"  # runs in float32
    FOLLOW = "follow"  # follows its inputs at O1, the policy's compute dtype at O2
    UNTOUCHED = "untouched"  # runs in its traced dtypes, for the reason given
    BY_TRAITS = "by traits"  # its traits decide (it passes values through, moves data, ...)
    HIGHER_ORDER = "higher order"  # the interpreter runs its body (interpret.py)


class Trait(enum.Flag):
    """What the dtype rule, the islands and the shadow need to know about a primitive beside
    its kind (see :data:`PRIMITIVES`); a primitive has any number of them."""

    NONE = 0
    # Takes operands of unrelated dtypes and passes them through.
    PASSES = enum.auto()
    # Only moves data: keeps its input's dtype and the first computing consumer casts. Besides
    # saving converts, this keeps backward reductions in float32: the transpose of broadcasting
    # a float32 bias is a float32 sum of the half cotangent, not a half sum.
    MOVES = enum.auto()
    # A cast commutes with it, so it can run on the half cast (see Values.move); resharding ops
    # move the value between devices.
    CAST_FIRST = enum.auto()
    # Is the cast itself.
    CAST = enum.auto()
    # Elementwise, broadcasting size-1 dimensions implicitly.
    ELEMENTWISE = enum.auto()
    # Its meaning depends on the bit width: always runs in its traced dtype.
    BIT_WIDTH = enum.auto()
    # Its float operands only decide something (a bool, an index, an order): it and the
    # values feeding it keep their traced dtype, so rounding cannot flip a decision.
    DECIDES = enum.auto()
    # Decides by an order (sort, argmax): no float32 rule for it makes a difference.
    ORDERS = enum.auto()
    # A reduction whose result is one of its operand's values, exact in any float dtype.
    EXACT = enum.auto()
    # Commutes with a cast down (a monotone rounding): relu(cast(x)) == cast(relu(x)).
    COMMUTES = enum.auto()
    # A constant operand is a fill or a bound: one beyond the half's range saturates.
    FILLS = enum.auto()
    # Combines a value that feeds a decision with the decision's result: p - floor(p) cancels
    # to the fractional part, which the half rounding of p would lose.
    CANCELS = enum.auto()
    # Passes a loop-carried value on, updated: y - 9e-4 * y, acc.at[i].add(v), a masked step
    # jnp.where(done, y, y_new). Run in the carry's traced dtype, the update is not lost below
    # half an ulp of the carry (an explicit Euler step in bfloat16 never moves y).
    CARRIES = enum.auto()
    # Extends a float32 island (see islands.py).
    ISLAND = enum.auto()
    # A test an island function may hold beside ISLAND ops: its boolean result picks between
    # float values (jnp.logaddexp's select of its NaN case).
    ISLAND_TEST = enum.auto()
    # Makes a constant array from literals or constants (see islands.remat_islands).
    CONSTANT = enum.auto()
    # An island's statistic when its result is small beside its operand (see islands.py).
    STATISTIC = enum.auto()
    # Elementwise and affine in its float operand: its backward pass needs no primal value.
    AFFINE = enum.auto()
    # May stand between a reduction and the broadcast of its result back.
    REBROADCAST = enum.auto()


_L, _F, _W, _BT = Kind.LOWER, Kind.F32, Kind.FOLLOW, Kind.BY_TRAITS
_T = Trait
PASSES, MOVES, CAST_FIRST, CAST, ELEMENTWISE, BIT_WIDTH = (
    _T.PASSES, _T.MOVES, _T.CAST_FIRST, _T.CAST, _T.ELEMENTWISE, _T.BIT_WIDTH
)  # fmt: skip
DECIDES, ORDERS, EXACT, COMMUTES, FILLS, CANCELS, CARRIES = (
    _T.DECIDES, _T.ORDERS, _T.EXACT, _T.COMMUTES, _T.FILLS, _T.CANCELS, _T.CARRIES
)  # fmt: skip
ISLAND, TEST, CONSTANT, STATISTIC, AFFINE, REBROADCAST, NONE = (
    _T.ISLAND, _T.ISLAND_TEST, _T.CONSTANT, _T.STATISTIC, _T.AFFINE, _T.REBROADCAST, _T.NONE
)  # fmt: skip

# One record per primitive autocast computes with: its kind and its traits.
_RECORDS: dict[str, tuple[Kind, Trait]] = {
    "abs": (_W, COMMUTES | ISLAND),
    "acos": (_F, NONE),
    "acosh": (_W, NONE),
    "add": (_W, ELEMENTWISE | CANCELS | CARRIES | ISLAND),
    "add_any": (_W, CANCELS | CARRIES | ISLAND),
    "and": (_W, TEST),
    "argmax": (_W, DECIDES | ORDERS),
    "argmin": (_W, DECIDES | ORDERS),
    "asin": (_F, NONE),
    "asinh": (_W, NONE),
    "atan": (_W, NONE),
    "atan2": (_W, ELEMENTWISE),
    "atanh": (_W, NONE),
    "bessel_i0e": (_W, NONE),
    "bessel_i1e": (_W, NONE),
    "bitcast_convert_type": (_BT, BIT_WIDTH),
    "broadcast_in_dim": (_W, MOVES | CAST_FIRST | ISLAND | CONSTANT | REBROADCAST),
    "cbrt": (_W, ISLAND),
    "ceil": (_W, NONE),
    "clamp": (_W, ELEMENTWISE | COMMUTES | FILLS | ISLAND),
    "concatenate": (_W, NONE),
    "conv_general_dilated": (_L, NONE),
    "convert_element_type": (_W, CAST | ISLAND | CONSTANT | AFFINE),
    "copy": (_W, MOVES | CAST_FIRST | AFFINE),
    "copy_p": (_BT, MOVES | CAST_FIRST | AFFINE),
    "cos": (_W, ISLAND),
    "cosh": (_F, NONE),
    "cumlogsumexp": (_F, NONE),
    "cummax": (_W, NONE),
    "cummin": (_W, NONE),
    "cumprod": (_F, NONE),
    "cumsum": (_F, NONE),
    "device_put": (_BT, PASSES),
    "digamma": (_W, NONE),
    "div": (_W, ELEMENTWISE | ISLAND),
    "dot_general": (_L, NONE),
    "dynamic_slice": (_W, MOVES | CAST_FIRST),
    "dynamic_update_slice": (_W, CARRIES),
    "eq": (_W, DECIDES | TEST),
    "erf": (_W, ISLAND),
    "erf_inv": (_F, NONE),
    "erfc": (_W, ISLAND),
    "exp": (_F, ISLAND),
    "exp2": (_F, ISLAND),
    "expand_dims": (_BT, MOVES | CAST_FIRST | ISLAND | CONSTANT),
    "expm1": (_F, ISLAND),
    "floor": (_W, NONE),
    "gather": (_W, MOVES | CAST_FIRST),
    "ge": (_W, DECIDES | TEST),
    "gt": (_W, DECIDES | TEST),
    "integer_pow": (_W, ISLAND),
    "iota": (_W, CONSTANT),
    "is_finite": (_W, DECIDES | TEST),
    "le": (_W, DECIDES | TEST),
    "lgamma": (_W, NONE),
    "log": (_F, ISLAND),
    "log1p": (_F, ISLAND),
    "logistic": (_W, ISLAND),
    "lt": (_W, DECIDES | TEST),
    "max": (_W, ELEMENTWISE | COMMUTES | FILLS | ISLAND),
    "mesh_cast": (_BT, PASSES | CAST_FIRST),
    "min": (_W, ELEMENTWISE | COMMUTES | FILLS | ISLAND),
    "mul": (_W, ELEMENTWISE | ISLAND),
    "name": (_BT, PASSES | AFFINE | REBROADCAST),
    "ne": (_W, DECIDES | TEST),
    "neg": (_W, COMMUTES | ISLAND | AFFINE),
    "nextafter": (_W, ELEMENTWISE | BIT_WIDTH),
    "not": (_W, TEST),
    "optimization_barrier": (_BT, PASSES),
    "or": (_W, TEST),
    "pad": (_W, FILLS),
    "pow": (_F, ELEMENTWISE | ISLAND),
    "pvary": (_BT, PASSES),
    "ragged_dot": (_L, NONE),
    "ragged_dot_general": (_L, NONE),
    "reduce_and": (_W, NONE),
    "reduce_max": (_W, EXACT | ISLAND),
    "reduce_min": (_W, EXACT | ISLAND),
    "reduce_or": (_W, NONE),
    "reduce_precision": (_W, BIT_WIDTH),
    "reduce_prod": (_F, NONE),
    "reduce_sum": (_F, ISLAND | STATISTIC),
    "reduce_window": (_W, NONE),
    "reduce_window_max": (_W, NONE),
    "reduce_window_min": (_W, NONE),
    "reduce_window_sum": (_W, NONE),
    "rem": (_W, ELEMENTWISE),
    "reshape": (_W, MOVES | CAST_FIRST | ISLAND | CONSTANT | REBROADCAST),
    "reshard": (_BT, PASSES | CAST_FIRST),
    "rev": (_W, MOVES | CAST_FIRST),
    "round": (_W, NONE),
    "rsqrt": (_F, ISLAND),
    "scatter": (_W, CARRIES),
    "scatter-add": (_W, CARRIES),
    "scatter-max": (_W, NONE),
    "scatter-min": (_W, NONE),
    "scatter-mul": (_W, NONE),
    "scatter-sub": (_W, CARRIES),
    "select_and_gather_add": (_W, NONE),
    "select_and_scatter_add": (_W, NONE),
    "select_n": (_W, ELEMENTWISE | COMMUTES | FILLS | CARRIES | ISLAND | AFFINE),
    "sharding_constraint": (_BT, PASSES | CAST_FIRST),
    "sign": (_W, COMMUTES | ISLAND),
    "sin": (_W, ISLAND),
    "sinh": (_F, NONE),
    "slice": (_BT, MOVES | CAST_FIRST),
    "sort": (_W, DECIDES | ORDERS),
    "split": (_W, NONE),
    "sqrt": (_W, ISLAND),
    "square": (_W, ISLAND),
    "squeeze": (_W, MOVES | CAST_FIRST | ISLAND | CONSTANT),
    "stack": (_W, NONE),
    "stop_gradient": (_BT, PASSES | ISLAND),
    "sub": (_W, ELEMENTWISE | CANCELS | CARRIES | ISLAND),
    "tan": (_F, NONE),
    "tanh": (_W, ISLAND),
    "tile": (_W, MOVES),
    "top_k": (_W, DECIDES | ORDERS),
    "transpose": (_W, MOVES | CAST_FIRST | ISLAND),
    "unstack": (_W, MOVES),
    "xor": (_W, NONE),
}  # fmt: skip

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


# Primitives whose body the interpreter runs: its own maps say how (by body parameter).
_HIGHER_ORDER = tuple(name for layout in interpret.LAYOUTS for name in layout.names)
_WHY = {
    Kind.LOWER: "matmul-like: tensor cores",
    Kind.F32: "loses accuracy or overflows in half",
    Kind.FOLLOW: "follows its inputs",
    Kind.BY_TRAITS: "its traits decide",
    Kind.HIGHER_ORDER: "the interpreter runs its body",
}


class Op(NamedTuple):
    """A primitive's record in :data:`PRIMITIVES`."""

    kind: Kind
    why: str  # for an untouched primitive, why autocast leaves it as traced
    traits: Trait = Trait.NONE


def _table(groups: Iterable[tuple[str, Op]]) -> dict[str, Op]:
    table: dict[str, Op] = {}
    for name, op in groups:
        if name in table:
            raise AssertionError(f"{name} is listed as {table[name].kind} and as {op.kind}")
        table[name] = op
    return table


# The one table: a record per primitive mpjax knows by name, with its kind, its traits and,
# for those left untouched, why. Every set of primitive names the rules use is derived from it
# (`having`). A primitive of the current JAX that is not in it is a test failure
# (tests/test_autocast.py), so a new JAX release cannot add one that falls out silently.
PRIMITIVES: dict[str, Op] = _table(
    [
        *((name, Op(kind, _WHY[kind], traits)) for name, (kind, traits) in _RECORDS.items()),
        *((name, Op(Kind.UNTOUCHED, why)) for name, why in _UNTOUCHED.items()),
        *((name, Op(Kind.HIGHER_ORDER, _WHY[Kind.HIGHER_ORDER])) for name in _HIGHER_ORDER),
    ]
)


def having(traits: Trait) -> frozenset[str]:
    """The primitives with any of `traits`, e.g. ``having(Trait.MOVES | Trait.PASSES)``."""
    return frozenset(name for name, op in PRIMITIVES.items() if op.traits & traits)


def _of_kind(kind: Kind) -> frozenset[str]:
    return frozenset(name for name, op in PRIMITIVES.items() if op.kind is kind)


LOWER_OPS: frozenset[str] = _of_kind(Kind.LOWER)
F32_OPS: frozenset[str] = _of_kind(Kind.F32)
FOLLOW_OPS: frozenset[str] = _of_kind(Kind.FOLLOW)
HIGHER_ORDER_OPS: frozenset[str] = _of_kind(Kind.HIGHER_ORDER)
UNTOUCHED_OPS: dict[str, str] = {
    name: op.why for name, op in PRIMITIVES.items() if op.kind is Kind.UNTOUCHED
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
