"""FP8 dot products with delayed scaling: the recipe, its state pytree, and the autocast hook."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from mpjax._src import hardware, levels
from mpjax._src import jax_compat as jc
from mpjax._src.float8.fp8_dot import (
    E4M3,
    E5M2,
    GRAD,
    INPUT,
    KERNEL,
    MX_BLOCK,
    NV_BLOCK,
    NVOptions,
    blocks_divide,
    check_scale,
    dot_sizes,
    finite_max,
    fp8_dot_current,
    fp8_dot_general,
    fp8_dot_mx,
    fp8_dot_nv,
    fp8_dot_rows,
    scale_of,
)
from mpjax._src.float8.recipes import (
    _RECIPES,
    CurrentScaling,
    DelayedScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from mpjax._src.interpreter import autocast as autocast_lib
from mpjax._src.interpreter import autocast_api, interpret, values
from mpjax._src.interpreter.first_order import Step
from mpjax._src.interpreter.rules import Hold
from mpjax._src.interpreter.values import Results
from mpjax._src.policy import Policy, is_float8
from mpjax._src.scaling import transform

_ROLES = 3
_ALIGN = 16  # tensor cores take FP8 matrices whose dimensions are multiples of 16


@functools.partial(jax.tree_util.register_dataclass, data_fields=("scale", "amax_history"),
                   meta_fields=("recipe",))  # fmt: skip
@dataclasses.dataclass(frozen=True)
class FP8State:
    """The delayed-scaling state of every FP8 dot site of a function: a plain pytree.

    Attributes:
      scale: float32 ``[sites, 3]``: the quantization scale of each site's input, kernel and
        gradient (``x_fp8 = x * scale``).
      amax_history: float32 ``[sites, 3, amax_history_len]``, newest first.
      recipe: the recipe, :class:`DelayedScaling`, :class:`CurrentScaling`,
        :class:`MXFP8BlockScaling` or :class:`NVFP4BlockScaling` (static: not a leaf).

    Example:
      >>> import jax, jax.numpy as jnp, mpjax.fp8
      >>> pol = mpjax.fp8.policy(recipe=mpjax.fp8.DelayedScaling(amax_history_len=4))
      >>> state = mpjax.fp8.init(lambda w, x: x @ w, pol, jnp.ones((32, 16)), jnp.ones((16, 32)))
      >>> [leaf.shape for leaf in jax.tree_util.tree_leaves(state)]   # the recipe is static
      [(1, 3), (1, 3, 4)]
    """

    scale: jax.Array
    amax_history: jax.Array
    recipe: Recipe

    @property
    def num_sites(self) -> int:
        """How many dot sites run in FP8.

        Example:
          >>> import jax.numpy as jnp, mpjax.fp8
          >>> f = lambda w, x: (x @ w) @ w.T   # two dot sites
          >>> state = mpjax.fp8.init(f, mpjax.fp8.policy(), jnp.ones((32, 16)), jnp.ones((16, 32)))
          >>> state.num_sites
          2
        """
        return int(self.scale.shape[-2])


@dataclasses.dataclass(frozen=True)
class FP8Policy:
    """A precision policy whose eligible ``dot_general`` ops run in FP8 (HYBRID).

    Every other op follows `base`. Dots in ``lax.scan`` bodies (nested scans and remat
    bodies in them included) are sites too, each counted once however many iterations run it,
    with the max of its amaxes over the iterations; so are the dots of each ``lax.cond`` or
    ``lax.switch`` branch (a step updates the sites of the branch it took). Dots whose
    contracting size or either operand's free size is not a multiple of 16, dots in float32
    regions, and dots inside while-loop or custom-derivative bodies run as `base` says (in its
    half dtype).

    Dots with batch dimensions (attention's scores ``q @ k.T`` and weighted values
    ``p @ v``, whose operands are both activations) stay in the base half dtype unless
    `batched_dots` is set, as TransformerEngine (``fp8_dpa=False``) and torchao (linear layers
    only) do by default: quantizing the attention probabilities, the step's largest
    activation, costs more passes over them than their small gemms save. In the H100 program
    of a GPT-style step (d_model 4096) delayed scaling is 1.32x faster than O2 bfloat16 by the
    roofline with them left out, 1.27x with them in FP8 (``benchmarks/fp8_program.py``). A dot
    ``jax.vmap`` batches is the one dot it maps: its site counts as unbatched.

    Attributes:
      base: the policy for everything else (a half level, O1 or O2).
      recipe: the scaling recipe: :class:`DelayedScaling` (the default),
        :class:`CurrentScaling`, :class:`MXFP8BlockScaling` or :class:`NVFP4BlockScaling`.
      batched_dots: whether dots with batch dimensions are sites too.

    Example:
      >>> import mpjax, mpjax.fp8
      >>> pol = mpjax.fp8.FP8Policy(mpjax.Policy.from_level("O1", "bfloat16"))
      >>> pol.base.level, pol.recipe.amax_history_len
      ('O1', 1024)
    """

    base: Policy
    recipe: Recipe = DelayedScaling()
    batched_dots: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, _RECIPES):
            raise TypeError(
                "recipe must be mpjax.fp8.DelayedScaling(...), mpjax.fp8.CurrentScaling(...), "
                "mpjax.fp8.MXFP8BlockScaling() or mpjax.fp8.NVFP4BlockScaling(...), got "
                f"{type(self.recipe).__name__}."
            )
        if not isinstance(self.base, Policy) or not levels.casts(self.base):
            raise ValueError(
                "FP8Policy needs a half-precision base policy such as "
                "mpjax.Policy.from_level('O1', 'bfloat16'); FP8 dots fall back to its half "
                "dtype when they are too small for FP8."
            )


def policy(
    level: str = "O1",
    half_dtype: DTypeLike = "bfloat16",
    recipe: Recipe | None = None,
    *,
    batched_dots: bool = False,
) -> FP8Policy:
    """Returns an FP8 policy: `level` in `half_dtype`, with dot_general in FP8.

    The FP8 formats are fixed by role (HYBRID, as TransformerEngine's default): E4M3 for
    inputs and kernels, E5M2 for output gradients; `half_dtype` is the base dtype of
    everything else.

    Args:
      level: the base level, "O1" or "O2" (or "O3").
      half_dtype: the base half dtype (bfloat16 by default, as FP8 training uses).
      recipe: ``DelayedScaling()`` (the default), ``CurrentScaling()``,
        ``MXFP8BlockScaling()`` or ``NVFP4BlockScaling()``.
      batched_dots: also run dots with batch dimensions (attention's) in FP8 (see
        :class:`FP8Policy`).

    Returns:
      An :class:`FP8Policy`.

    Example:
      >>> import mpjax.fp8
      >>> p = mpjax.fp8.policy("O2", recipe=mpjax.fp8.DelayedScaling(margin=1))
      >>> str(p.base), p.recipe.margin
      ('p=full,c=bf16,o=full,level=O2', 1)
    """
    if is_float8(half_dtype):
        name = getattr(half_dtype, "__name__", str(half_dtype))
        raise ValueError(
            f"half_dtype is {name}: it is the base dtype of the ops that do not run in FP8 "
            "(bfloat16 or float16). The FP8 formats are fixed by role: E4M3 for the dots' "
            "inputs and kernels, E5M2 for their output gradients. Use "
            "mpjax.fp8.policy(level, 'bfloat16')."
        )
    return FP8Policy(Policy.from_level(level, half_dtype), recipe or DelayedScaling(), batched_dots)


# -- the recipe ----------------------------------------------------------------------------------

_FP8_MAX = np.array([finite_max(E4M3), finite_max(E4M3), finite_max(E5M2)], np.float32)


def _scale_from_history(history: jax.Array, scale: jax.Array, recipe: Recipe) -> Any:
    if recipe.amax_compute_algo == "max":
        amax = jnp.max(history, axis=-1)
    else:
        amax = history[..., 0]
    # An amax of zero or inf/NaN keeps the previous scale.
    new, ok = scale_of(amax, jnp.asarray(_FP8_MAX), recipe.margin, scale)
    return new.astype(jnp.float32), ok


def update(state: FP8State, amax: jax.Array) -> FP8State:
    """Returns the state after a step that saw `amax` (float32 ``[sites, 3]``).

    Example:
      >>> import jax.numpy as jnp, mpjax.fp8
      >>> s = mpjax.fp8.FP8State(jnp.ones((1, 3)), jnp.zeros((1, 3, 2)),
      ...                        mpjax.fp8.DelayedScaling(amax_history_len=2))
      >>> mpjax.fp8.update(s, jnp.array([[448.0, 0.0, 57344.0]])).scale
      Array([[1., 1., 1.]], dtype=float32)
    """
    amax = jnp.asarray(amax, jnp.float32)
    hist = jnp.concatenate([amax[..., None], state.amax_history[..., :-1]], axis=-1)
    scale, _ = _scale_from_history(hist, state.scale, state.recipe)
    return FP8State(scale, hist, state.recipe)


def merge(states: Sequence[FP8State]) -> FP8State:
    """Combines the states that microbatches of one step produced from the same state.

    Gradient accumulation: each microbatch's :func:`scaled_value_and_grad` returns a new state; the
    merged one holds, for each tensor, the largest amax of the step (not the last
    microbatch's, as the gradient-overwrite trick keeps, nor their sum), and its scale.

    Args:
      states: the new states, all made from one state by one step each.

    Returns:
      The state as if the whole batch had been one step.

    Example:
      >>> import jax.numpy as jnp, mpjax.fp8
      >>> r = mpjax.fp8.DelayedScaling(amax_history_len=1)
      >>> s0 = mpjax.fp8.FP8State(jnp.ones((1, 3)), jnp.zeros((1, 3, 1)), r)
      >>> a = mpjax.fp8.update(s0, jnp.array([[1.0, 4.0, 2.0]]))
      >>> b = mpjax.fp8.update(s0, jnp.array([[2.0, 1.0, 2.0]]))
      >>> mpjax.fp8.merge([a, b]).amax_history[..., 0]
      Array([[2., 4., 2.]], dtype=float32)
    """
    states = list(states)
    if not states:
        raise ValueError("merge needs at least one state.")
    recipe = states[0].recipe
    if any(s.recipe != recipe for s in states):
        raise ValueError("merge got states of different recipes.")
    hists = jnp.stack([s.amax_history for s in states])
    scales = jnp.stack([s.scale for s in states])
    hist = jnp.max(hists, axis=0)
    # Where the merged amax cannot give a scale (zero or not finite), some microbatch kept
    # the previous scale: take that one.
    _, oks = jax.vmap(lambda h, s: _scale_from_history(h, s, recipe))(hists, scales)
    fallback_ix = jnp.argmax(~oks, axis=0)
    fallback = jnp.take_along_axis(scales, fallback_ix[None], axis=0)[0]
    scale, _ = _scale_from_history(hist, fallback, recipe)
    return FP8State(scale, hist, recipe)


# -- running a function with FP8 dots ------------------------------------------------------------


def _eligible(eqn: Any, batched_dots: bool = False, any_rows: bool = False) -> bool:
    """Whether `eqn` is a dot that may run in FP8: float operands, no batch dimensions
    (unless `batched_dots`), sizes in multiples of 16; with `any_rows` (the block recipes,
    which pad the rows) the lhs's free size may be any."""
    if eqn.primitive.name != "dot_general":
        return False
    lhs, rhs = (v.aval for v in eqn.invars)
    if not (jnp.issubdtype(lhs.dtype, jnp.floating) and jnp.issubdtype(rhs.dtype, jnp.floating)):
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lb and not batched_dots:  # attention's scores and weighted values (see FP8Policy)
        return False
    contract = int(np.prod([lhs.shape[d] for d in lc]))
    lfree = int(np.prod([n for d, n in enumerate(lhs.shape) if d not in (*lc, *lb)]))
    rfree = int(np.prod([n for d, n in enumerate(rhs.shape) if d not in (*rc, *rb)]))
    aligned = (contract, rfree) if any_rows else (contract, lfree, rfree)
    return lfree > 0 and all(n > 0 and n % _ALIGN == 0 for n in aligned)


def _has_eligible(jaxpr: Any, batched_dots: bool, any_rows: bool = False) -> bool:
    """Whether `jaxpr` or any jaxpr nested in it has an eligible dot (may be a site)."""
    return any(_eligible(eqn, batched_dots, any_rows) for eqn in interpret.eqns_within(jaxpr))


def _trace_state() -> Any:
    """The current trace, to tell a body traced apart from the evaluation around it."""
    get = getattr(jex_core, "get_opaque_trace_state", None)
    if get is None:  # JAX 0.6: only jax.core has it, with an unused argument
        return getattr(jax.core, "get_opaque_trace_state")("mpjax")  # noqa: B009
    return get()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _spread(length: int, sink: jax.Array) -> jax.Array:
    """`sink` repeated for each of `length` iterations; its cotangent is their max (not sum)."""
    return jnp.broadcast_to(sink, (length, *sink.shape))


def _spread_fwd(length: int, sink: jax.Array) -> tuple[jax.Array, None]:
    return _spread(length, sink), None


def _spread_bwd(length: int, res: None, g: jax.Array) -> tuple[jax.Array]:
    del length, res
    return (jnp.max(g, axis=0, initial=0.0),)  # amaxes are >= 0; a scan may run 0 times


_spread.defvjp(_spread_fwd, _spread_bwd)


def _wider_float(x: Any, dtype: Any) -> bool:
    """Whether `x` is a float array of more bytes an element than `dtype`."""
    return (
        isinstance(x, jax.Array)
        and jnp.issubdtype(x.dtype, jnp.floating)
        and np.dtype(x.dtype).itemsize > np.dtype(dtype).itemsize
    )


class _Sites:
    """The FP8 sites of a function under autocast: its eligible dots, numbered in evaluation
    order and run in FP8 (see :meth:`rules`).

    Sites are the dots evaluated at the top level and in scan bodies, nested ones included
    (each counted once however many times it runs). A scan body gets the scales as a constant
    and the amax sinks as a scanned input, one row per iteration: the cotangent of those rows
    is stacked by scan's transpose, and :func:`_spread` takes its max over the iterations. A
    remat body and each branch of a cond get both as operands; the sites of a branch not
    taken see no amax that step (zero), so their scales stay. The bodies of while loops and
    custom-derivative rules are traced apart from these frames, so their dots stay in the
    base half dtype (a while loop has no reverse-mode gradient to carry amaxes out).
    """

    def __init__(self, scale: jax.Array | None, sink: jax.Array | None, pol: FP8Policy):
        self.count = 0
        # Current scaling: scales from each tensor's amax, not from the state.
        self.current = pol.recipe if isinstance(pol.recipe, CurrentScaling) else None
        # MXFP8: block scales from each block's amax; gemms scale blocks on compute
        # capability 10 (decided when the function is traced: hardware.py).
        self.mx = isinstance(pol.recipe, MXFP8BlockScaling)
        # NVFP4: the same, in blocks of 16 under a tensor scale (its switches per site).
        self.nv = pol.recipe if isinstance(pol.recipe, NVFP4BlockScaling) else None
        # Both pad a dot's rows to their blocks (fp8_dot._rows_padded): any row count runs.
        self.pads_rows = self.mx or self.nv is not None
        # Regions under another policy (a per-module rule of mpjax.flax.wrap) stay out of FP8.
        self.base = pol.base
        self.batched_dots = pol.batched_dots
        # (trace, scale, sink) of the top level and of each scan or remat body being traced
        self.frames: list[tuple[Any, Any, Any]] = [(_trace_state(), scale, sink)]
        # A block recipe's sites quantize a float32 value, not the half copy a convert made
        # of it (see _held): id(half copy) -> (half copy, the float32 value).
        self.narrowed: dict[int, tuple[Any, Any]] = {}

    def __call__(self, eqn: Any, invals: list[Any], mode: Any, keep_constants: bool) -> Any:
        if eqn.primitive.name not in mode.lower_ops:
            return None
        if not _eligible(eqn, self.batched_dots, any_rows=self.pads_rows):
            return None
        if self.base is not None and mode != self.base:
            return None
        trace, scale, sink = self.frames[-1]
        if _trace_state() != trace:
            return None
        dims = eqn.params["dimension_numbers"]
        lhs_shape, rhs_shape = (v.aval.shape for v in eqn.invars)
        sizes = dot_sizes(lhs_shape, rhs_shape, dims)
        if self.mx and not blocks_divide(MX_BLOCK, *sizes):
            return None  # not in blocks of 32: the base half (the audit names it)
        if self.nv is not None and not self._nv_runs(sizes):
            return None  # not in blocks of 16, or a layer kept in high precision
        i = self.count
        self.count += 1
        dt = np.dtype(mode.compute_dtype)
        # A block recipe quantizes a float32 operand from itself, as TransformerEngine
        # quantizes a master weight: not from the half copy the policy made of it, which is
        # one pass over the weight more and a second rounding. Only in a one-device program
        # (hardware.one_device): under SPMD the half copy is what the partitioner gathers.
        held = scale is not None and self.pads_rows and hardware.one_device()
        if held:
            invals = [self._held(x) for x in invals]
        lhs, rhs = (
            x if held and _wider_float(x, dt) else values.cast(x, dt, keep_constant=keep_constants)
            for x in invals
        )
        if scale is None:  # counting sites (init)
            return lax.dot_general(lhs, rhs, dims, preferred_element_type=dt)
        if self.mx:
            return fp8_dot_mx(dims, dt, hardware.block_scaled_gemms(), lhs, rhs, sink[i])
        if self.nv is not None:
            r = self.nv
            opts = NVOptions(r.random_hadamard, r.stochastic_rounding, r.square_weight_blocks,
                             seed=r.seed * 100_003 + i)  # fmt: skip
            return fp8_dot_nv(dims, dt, hardware.block_scaled_gemms(), opts, lhs, rhs, sink[i])
        if self.current is not None:
            dot = fp8_dot_rows if self.current.granularity == "row" else fp8_dot_current
            return dot(dims, dt, self.current.margin, lhs, rhs, sink[i])
        return fp8_dot_general(dims, eqn.params.get("precision"), dt, lhs, rhs, scale[i], sink[i])

    def _held(self, x: Any) -> Any:
        """The wider float value that `x` was narrowed from in this frame (a float32 master
        weight, where `x` is its half copy), else `x` itself."""
        found = self.narrowed.get(id(x))
        return x if found is None or found[0] is not x else found[1]

    def _nv_runs(self, sizes: tuple[int, ...]) -> bool:
        assert self.nv is not None
        if not blocks_divide(NV_BLOCK, *sizes):
            return False
        # autocast runs each rule under the equation's full name stack
        return not self.nv._keeps(str(jc.current_name_stack()))

    def rules(self) -> interpret.Registry:
        """Autocast's rules, with eligible dots run in FP8 at their sites, and the scales and
        amax sinks passed into the bodies of scans, remats and conds that hold sites."""
        rules = autocast_lib.RULES.extend()

        @rules.register("dot_general")
        def dot(step: Step, invals: list[Any]) -> Results:
            if isinstance(step.mode, Policy):
                out = self(step.eqn, invals, step.mode, step.ctx.shadow)
                if out is not None:
                    return [out], [Hold.NONE]
            return rules.inherited(step.eqn)(step, invals)

        @rules.register("convert_element_type")
        def convert(step: Step, invals: list[Any]) -> Results:
            outs, holds = rules.inherited(step.eqn)(step, invals)
            x, y = invals[0], outs[0]
            narrowing = isinstance(y, jax.Array) and jnp.issubdtype(y.dtype, jnp.floating)
            if self.pads_rows and narrowing and _wider_float(x, y.dtype):
                self.narrowed[id(y)] = (y, x)
            return outs, holds

        @rules.register(*interpret.SCAN.names, *interpret.COND.names, *interpret.REMAT.names)
        def body(step: Step, invals: list[Any]) -> Results:
            if isinstance(step.mode, Policy):
                extra = self.body(step.eqn, step.mode)
                if extra is not None:
                    out = autocast_lib.bind_with_bodies(step, invals, extra)
                    if out is not None:
                        return out
            return rules.inherited(step.eqn)(step, invals)

        return rules

    def body(self, eqn: Any, mode: Any) -> Any:
        """The scales and sinks a scan, remat or cond body needs for its sites (see
        autocast's _bind_with_operands), or None where it holds none."""
        trace, scale, sink = self.frames[-1]
        bodies = [interpret.open_jaxpr(b)[0] for b in interpret.bodies(eqn)]
        if _trace_state() != trace or not any(
            _has_eligible(b, self.batched_dots, self.pads_rows) for b in bodies
        ):
            return None
        consts = [] if scale is None else [scale, sink]
        xs = []
        if scale is not None and interpret.SCAN.of(eqn):
            consts, xs = [scale], [_spread(eqn.params["length"], sink)]

        @contextlib.contextmanager
        def enter(consts: list[Any], rows: list[Any]) -> Iterator[None]:
            inner = [*consts, *rows] or [None, None]
            self.frames.append((_trace_state(), inner[0], inner[1]))
            try:
                yield
            finally:
                self.frames.pop()

        return consts, xs, enter


# How many mpjax.fp8 runs are tracing their function now (see warn_outside).
_TRACING = [0]


def warn_outside(model: str, pol: FP8Policy, stacklevel: int) -> None:
    """Warns that a model wrapped with an FP8 policy runs outside mpjax.fp8, where its dots
    run in the base half dtype: the loss that calls it needs mpjax.fp8.scaled_value_and_grad
    (training) or mpjax.fp8.apply (evaluation)."""
    if _TRACING[0]:
        return
    half = np.dtype(pol.base.compute_dtype).name
    warnings.warn(
        f"{model} was wrapped with an FP8 policy but runs outside mpjax.fp8, so its dots run "
        f"in {half} (the base policy), not FP8. Differentiate the loss that calls it with "
        "mpjax.fp8.scaled_value_and_grad(loss, policy)(fp8_state, params, ...) (or evaluate "
        "it with mpjax.fp8.apply); wrap it with policy.base to run the base policy on purpose.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


def _run(fn: Callable[..., Any], pol: FP8Policy, sites: _Sites, args: tuple[Any, ...]) -> Any:
    # Fused kernels (attention) run in the base policy's half.
    ctx = autocast_lib.Context(pol.base, {}, rules=sites.rules())
    _TRACING[0] += 1
    try:
        closed, out_tree, dyn = autocast_api.trace_call(ctx, fn, args, {})
    finally:
        _TRACING[0] -= 1
    return jax.tree_util.tree_unflatten(out_tree, autocast_api.evaluate(ctx, closed, dyn))


def _check(pol: Any) -> FP8Policy:
    if not isinstance(pol, FP8Policy):
        raise TypeError(
            f"expected an mpjax.fp8.FP8Policy, got {type(pol).__name__}; build one with "
            "mpjax.fp8.policy('O1')."
        )
    return pol


def init(fn: Callable[..., Any], pol: FP8Policy, *example_args: Any) -> FP8State:
    """Returns the initial FP8 state of `fn`: one site per eligible dot_general it runs.

    Scales start at 1 and histories at 0, so the first step runs with scale 1 (as
    TransformerEngine) and sets the scales from its amaxes.

    Args:
      fn: the function (usually the loss) to run with FP8 dots; not differentiated here.
      pol: the :class:`FP8Policy`.
      *example_args: arguments of the shapes and dtypes `fn` will be called with (only
        their shapes are used).

    Returns:
      The :class:`FP8State`.

    Example:
      >>> import jax.numpy as jnp, mpjax.fp8
      >>> loss = lambda w, x: jnp.sum((x @ w) ** 2)
      >>> state = mpjax.fp8.init(loss, mpjax.fp8.policy(), jnp.ones((32, 16)), jnp.ones((16, 32)))
      >>> state.num_sites, state.amax_history.shape
      (1, (1, 3, 1024))
    """
    pol = _check(pol)
    count = []

    def counted(*args: Any) -> Any:
        sites = _Sites(None, None, pol)
        out = _run(fn, pol, sites, args)
        count.append(sites.count)
        return out

    jax.eval_shape(counted, *example_args)
    n, length = count[0], pol.recipe.amax_history_len
    if n == 0:
        warnings.warn(
            "mpjax.fp8.init: the function has no dot_general that can run in FP8, so nothing "
            "will: a dot qualifies when its contracting size and each operand's free size are "
            "multiples of 16, it has no batch dimensions (attention's: unless the policy "
            "has batched_dots=True) and it is not inside a while_loop or a custom-derivative "
            "rule. "
            "The function runs as its base policy, " + str(pol.base) + ".",
            UserWarning,
            stacklevel=2,
        )
    return FP8State(
        jnp.ones((n, _ROLES), jnp.float32),
        jnp.zeros((n, _ROLES, length), jnp.float32),
        pol.recipe,
    )


def _check_state(state: Any, pol: FP8Policy) -> FP8State:
    if not isinstance(state, FP8State):
        raise TypeError(f"expected an FP8State from mpjax.fp8.init, got {type(state).__name__}.")
    if state.recipe != pol.recipe:
        raise ValueError("the state was made for another recipe than the policy's.")
    check_scale(state.scale, "the FP8 state's scales")
    return state


def _num_mismatch(expected: int, got: int) -> ValueError:
    return ValueError(
        f"the FP8 state has {expected} dot sites but the function ran {got}: make the state "
        "with mpjax.fp8.init on the same function and argument shapes."
    )


def apply(fn: Callable[..., Any], pol: FP8Policy) -> Callable[..., Any]:
    """Returns ``f(state, *args)``: `fn` run with FP8 dots at the state's scales (no update).

    For evaluation; training uses :func:`scaled_value_and_grad`, which also returns the new state.

    Example:
      >>> import jax.numpy as jnp, mpjax.fp8
      >>> f = lambda w, x: x @ w
      >>> pol = mpjax.fp8.policy()
      >>> w, x = jnp.ones((32, 16)), jnp.ones((16, 32))
      >>> state = mpjax.fp8.init(f, pol, w, x)
      >>> mpjax.fp8.apply(f, pol)(state, w, x)[0, 0]
      Array(32., dtype=float32)
    """
    pol = _check(pol)

    def wrapped(state: FP8State, *args: Any) -> Any:
        state = _check_state(state, pol)
        n = state.num_sites
        sites = _Sites(state.scale, jnp.zeros((n, _ROLES), jnp.float32), pol)
        out = _run(fn, pol, sites, args)
        if sites.count != n:
            raise _num_mismatch(n, sites.count)
        return out

    return wrapped


def scaled_value_and_grad(
    fn: Callable[..., Any], pol: FP8Policy, *, has_aux: bool = False
) -> Callable[..., Any]:
    """Returns ``f(state, params, *args, opt_state=None) -> (value, grads, new_state)``.

    The contract of :func:`mpjax.scaled_value_and_grad` (the scaling state first, then what
    is differentiated, then the batch; the value, then the gradients), plus the FP8 state's
    next scales, which only this step's backward pass knows.

    With ``opt_state=`` (an optimizer state holding :func:`mpjax.loss_scale`, a
    :class:`mpjax.flax.TrainState` or an ``nnx.Optimizer``), the loss is scaled as
    :func:`mpjax.scaled_value_and_grad` scales it: `value` is the loss as computed and
    `grads` are the gradients of the scaled loss, which ``tx.update`` unscales, checks and
    skips exactly. A float16 base needs it, as float16 O1/O2 does. The FP8 state keeps the
    amaxes of the unscaled gradients and quantizes the scaled ones at their scale divided by
    the loss scale, so a loss scale that halves or doubles never saturates a gradient.

    `fn(params, *args)` runs under ``pol.base`` with its eligible dots in FP8 at the
    state's scales; `grads` is the gradient with respect to `params`; `new_state` holds the
    amaxes of this step (those of the gradients too, known only in the backward pass) and
    the scales for the next step. With ``has_aux=True``, `value` is ``(loss, aux)``.

    The state is threaded by hand, like a loss scale, and never goes near the optimizer.
    This is safer than the gradient-overwrite trick (Flax's ``fp8_ops``, where the new state
    comes out as the "gradient" of state variables and must overwrite them):

    - a state filter or ``optax.masked``/``multi_transform`` that drops or zeroes those
      "gradients" silently freezes the scales;
    - gradient accumulation (``optax.MultiSteps``, a microbatch loop) sums or averages the
      overwrite "gradients", or keeps only the last microbatch's amax; :func:`merge` keeps
      the max;
    - a ``TrainState`` whose tree holds the FP8 variables changes shape between params and
      grads, and breaks checkpoints and sharding specs;
    - an optax chain applies Adam moments, weight decay or clipping to the state unless every
      transform is told to skip it.

    Args:
      fn: the loss, ``fn(params, *args)`` returning a float scalar (or ``(loss, aux)``).
      pol: the :class:`FP8Policy`.
      has_aux: whether `fn` returns ``(loss, aux)``.

    Returns:
      A function of ``(state, params, *args)``.

    Raises:
      ValueError: if the state was not made by :func:`init` for this function's shapes.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax.fp8
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> pol = mpjax.fp8.policy("O1")
      >>> w, x = jnp.full((32, 16), 0.5), jnp.ones((16, 32))
      >>> state = mpjax.fp8.init(loss, pol, w, x)
      >>> step = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))
      >>> value, grads, state = step(state, w, x)
      >>> float(value), grads.shape, state.amax_history[0, :, 0].tolist()
      (256.0, (32, 16), [1.0, 0.5, 0.125])
    """
    pol = _check(pol)

    def wrapped(state: FP8State, params: Any, *args: Any, opt_state: Any = None) -> Any:
        state = _check_state(state, pol)
        n = state.num_sites
        counts = []
        loss_scale = None if opt_state is None else transform.loss_scale_of(opt_state)
        # The gradients' scales apply to the unscaled gradients: the scaled ones are S times
        # larger, so they are quantized at scale / S, and their amaxes recorded divided by S.
        by = jnp.ones(_ROLES, jnp.float32)
        if loss_scale is not None:
            by = by.at[GRAD].set(jnp.asarray(loss_scale.loss_scale, jnp.float32))

        def inner(p: Any, sink: jax.Array) -> Any:
            sites = _Sites(state.scale / by, sink, pol)
            out = _run(fn, pol, sites, (p, *args))
            counts.append(sites.count)
            out = out if has_aux else (out, None)
            loss = out[0] if loss_scale is None else loss_scale.scale(out[0])
            return loss, out

        sink = jnp.zeros((n, _ROLES), jnp.float32)
        (_, (loss, aux)), (grads, amax) = jax.value_and_grad(inner, argnums=(0, 1), has_aux=True)(
            params, sink
        )
        if counts[0] != n:
            raise _num_mismatch(n, counts[0])
        value = (loss, aux) if has_aux else loss
        return value, grads, update(state, amax / by)

    return wrapped


# -- reading the state ---------------------------------------------------------------------------


def describe(state: FP8State) -> list[dict[str, float]]:
    """Per-site rows of an FP8 state: each tensor's scale and the amax it was set from.

    Sites are numbered in the order the function first runs their dots (the order of
    ``mpjax.audit(...).fp8_matmuls`` in its forward pass). The amax is the one the recipe uses:
    the max of the history, or its newest entry. A scale of 1 with an amax of 0 is a tensor
    not seen yet; a non-finite amax kept the previous scale.

    Args:
      state: an :class:`FP8State` (not batched).

    Returns:
      One dict per site: ``site``, then ``{input,kernel,grad}_scale`` and
      ``{input,kernel,grad}_amax`` as floats.

    Example:
      >>> import jax.numpy as jnp, mpjax.fp8
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> pol = mpjax.fp8.policy("O1")
      >>> w, x = jnp.full((32, 16), 0.5), jnp.ones((16, 32))
      >>> state = mpjax.fp8.init(loss, pol, w, x)
      >>> _, _, state = mpjax.fp8.scaled_value_and_grad(loss, pol)(state, w, x)
      >>> row = mpjax.fp8.describe(state)[0]
      >>> row["kernel_amax"], row["kernel_scale"], row["grad_amax"]
      (0.5, 896.0, 0.125)
    """
    if not isinstance(state, FP8State):
        raise TypeError(f"expected an FP8State from mpjax.fp8.init, got {type(state).__name__}.")
    scale = np.asarray(state.scale, np.float64)
    hist = np.asarray(state.amax_history, np.float64)
    if scale.ndim != 2:
        raise ValueError(
            f"describe takes one state (scale [sites, 3]), got scale of shape {scale.shape}; "
            "index a batched state first."
        )
    with np.errstate(invalid="ignore"):
        amax = hist.max(axis=-1) if state.recipe.amax_compute_algo == "max" else hist[..., 0]
    roles = (("input", INPUT), ("kernel", KERNEL), ("grad", GRAD))
    rows = []
    for i in range(scale.shape[0]):
        row: dict[str, float] = {"site": i}
        row.update({f"{role}_scale": float(scale[i, r]) for role, r in roles})
        row.update({f"{role}_amax": float(amax[i, r]) for role, r in roles})
        rows.append(row)
    return rows


value_and_grad = transform.renamed(
    "mpjax.fp8.value_and_grad", "mpjax.fp8.scaled_value_and_grad", scaled_value_and_grad
)
# jnp.finfo(dtype).max does this job: one name for it.
fp8_max = transform.renamed("mpjax.fp8.fp8_max(dtype)", "float(jnp.finfo(dtype).max)", finite_max)
