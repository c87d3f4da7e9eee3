"""The FP8 recipes: how each dot site's scales are chosen (TransformerEngine's names)."""

from __future__ import annotations

import dataclasses

from mpjax._src.interpreter.module_paths import glob_path, module_path


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """TransformerEngine's ``DelayedScaling`` recipe (HYBRID format).

    Each dot site keeps, for its input, kernel and output gradient, a scale and a history of
    the last ``amax_history_len`` absolute maxima (newest first). After each step the amax seen
    in that step enters the history, and the scale for the next step is
    ``fp8_max / amax / 2**margin``, where ``amax`` is the history's maximum (``"max"``) or
    its newest entry (``"most_recent"``). As in TransformerEngine, an amax of zero or a
    non-finite amax keeps the previous scale.

    Attributes:
      margin: the scale is divided by ``2**margin`` (headroom for growing values).
      amax_history_len: how many steps of amax each tensor remembers.
      amax_compute_algo: ``"max"`` (of the history) or ``"most_recent"``.

    Example:
      >>> import mpjax.fp8
      >>> mpjax.fp8.DelayedScaling(margin=1, amax_history_len=16).amax_compute_algo
      'max'
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo must be 'max' or 'most_recent', got "
                f"{self.amax_compute_algo!r} (TransformerEngine's two algorithms)."
            )
        if int(self.amax_history_len) < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}.")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}.")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Current scaling (TransformerEngine's ``Float8CurrentScaling``, torchao's tensorwise and
    rowwise recipes): each tensor is quantized with a scale from its own amax in this step,
    ``fp8_max / amax / 2**margin``, the input and kernel's in the forward pass, the output
    gradient's in the backward pass. No scale goes stale, at the cost of reading each tensor
    for its amax before quantizing it. An amax of zero or a non-finite one quantizes at
    scale 1 (an inf then saturates at the FP8 maximum, as with delayed scaling). The state
    keeps the last step's amaxes (per tensor), for :func:`describe`.

    With ``granularity="row"`` each row of a dot's operands along its contraction gets its
    own scale (the input's rows, the kernel's columns, the output gradient's rows for the
    input gradient and its columns for the weight gradient): one large row no longer
    coarsens the others. Each operand is then quantized once per gemm it enters, along that
    gemm's contraction (forward and backward differ), so the backward pass keeps the half
    operands, not float8 ones; the scales multiply each gemm's result.

    Attributes:
      margin: the scale is divided by ``2**margin``.
      granularity: ``"tensor"`` (one scale per tensor) or ``"row"``.

    Example:
      >>> import mpjax.fp8
      >>> mpjax.fp8.policy("O2", recipe=mpjax.fp8.CurrentScaling(granularity="row")).recipe
      CurrentScaling(margin=0, granularity='row')
    """

    margin: int = 0
    granularity: str = "tensor"
    amax_history_len: int = dataclasses.field(default=1, init=False, repr=False)
    amax_compute_algo: str = dataclasses.field(default="most_recent", init=False, repr=False)

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}.")
        if self.granularity not in ("tensor", "row"):
            raise ValueError(
                f"granularity must be 'tensor' or 'row', got {self.granularity!r}: "
                "CurrentScaling(granularity='row') scales each row of a dot's operands."
            )


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling:
    """TransformerEngine's ``MXFP8BlockScaling`` recipe (OCP MX), the FP8 training of NVIDIA
    Blackwell (B200, GB200), whose tensor cores scale blocks themselves.

    Every gemm runs in E4M3, the backward ones too (the input and weight gradients). Each
    operand is quantized from its high-precision value along the axis each of its gemms
    contracts (a transpose of the forward copy is not the same numbers), in blocks of 32
    consecutive elements, each with a power-of-two scale: the block's amax / 448 rounded up
    (E8M0). No scale is kept between steps; the state holds each tensor's amax of the last
    step, for :func:`describe`.

    On a GPU of compute capability 10 each gemm is a cuDNN block-scaled dot
    (``jax.nn.scaled_matmul``, which XLA makes ``__cudnn$blockScaledDot`` with cuDNN 9.10 or
    newer). Elsewhere (Hopper, TPU, CPU), where no gemm scales blocks, the same numbers are
    emulated: the E4M3 values times their scales, exactly representable in bfloat16, in a
    bfloat16 gemm with float32 sums. ``mpjax.audit(..., target="b200")`` compiles the B200's
    program. A dot whose contraction or right operand's free size (a Dense layer's features)
    does not divide into blocks of 32 runs in the base policy's half; its rows (the batch,
    the tokens) are padded with zero rows to the block instead, exactly (a zero row changes no
    block's amax), so a site does not come and go with the batch size.

    Example:
      >>> import mpjax.fp8
      >>> mpjax.fp8.policy("O2", recipe=mpjax.fp8.MXFP8BlockScaling()).recipe
      MXFP8BlockScaling()
    """

    margin: int = dataclasses.field(default=0, init=False, repr=False)
    amax_history_len: int = dataclasses.field(default=1, init=False, repr=False)
    amax_compute_algo: str = dataclasses.field(default="most_recent", init=False, repr=False)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling:
    """TransformerEngine's ``NVFP4BlockScaling`` recipe: NVIDIA's 4-bit training for Blackwell
    (B200, GB200), whose tensor cores run E2M1 gemms that scale blocks themselves.

    Every gemm runs in E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6), the backward ones too. Each
    operand is quantized from its high-precision value along the axis each of its gemms
    contracts, in blocks of 16 with an E4M3 scale each (the block's amax / 6), under a float32
    scale per tensor (its amax / (6 x 448)), as NVIDIA's recipe does:

    - the weight (a dot's right operand) is scaled in 16 x 16 tiles, so that its input-gradient
      gemm contracts the same numbers (`square_weight_blocks`), and is quantized once a step;
    - the weight gradient's operands are rotated by a random Hadamard transform along the
      tokens it sums over (`random_hadamard`: exact in real arithmetic, it spreads each block's
      outliers before they are rounded);
    - gradients round stochastically (`stochastic_rounding`), unbiased: a hash of each
      element's bits, its position, its site and `seed`, so a step replays exactly.

    `high_precision` names the layers that stay in the base half dtype: globs matched against
    each dot's module path or name scope (``"head"``, ``"layers_11/*"``). NVIDIA keeps the
    last few blocks and the head in bfloat16; off by default, as in TransformerEngine.

    On a GPU of compute capability 10 each gemm is a cuDNN block-scaled dot
    (``jax.nn.scaled_matmul``); elsewhere the same numbers are emulated (the values times
    their block scales, exact in bfloat16, in a bfloat16 gemm with float32 sums, times the
    tensor scales). A dot whose contraction or right operand's free size does not divide by 16
    runs in the base half; its rows are padded, as :class:`MXFP8BlockScaling`'s are.

    Example:
      >>> import mpjax.fp8
      >>> r = mpjax.fp8.NVFP4BlockScaling(high_precision=("head",))
      >>> mpjax.fp8.policy("O2", recipe=r).recipe.stochastic_rounding
      True
    """

    random_hadamard: bool = True
    stochastic_rounding: bool = True
    square_weight_blocks: bool = True
    high_precision: tuple[str, ...] = ()
    seed: int = 0
    margin: int = dataclasses.field(default=0, init=False, repr=False)
    amax_history_len: int = dataclasses.field(default=1, init=False, repr=False)
    amax_compute_algo: str = dataclasses.field(default="most_recent", init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.high_precision, str) or not all(
            isinstance(p, str) for p in self.high_precision
        ):
            raise TypeError(
                "high_precision is a tuple of module-path globs, like ('head', 'layers_11/*'), "
                f"got {self.high_precision!r}."
            )
        object.__setattr__(self, "high_precision", tuple(self.high_precision))

    def _keeps(self, name_stack: str) -> bool:
        """Whether a dot under `name_stack` stays in the base half (`high_precision`): each
        glob is matched against the dot's module path, with and without its top module's
        name (``"Dense_0"`` and ``"TransformerLM/Dense_0"`` both name the head, and not
        ``"Block_0/Dense_0"``), or its ``jax.named_scope`` names."""
        path = module_path(name_stack)
        if path is None:
            return False
        paths = [path, path.partition("/")[2]]
        return any(glob_path(p, pattern) for pattern in self.high_precision for p in paths if p)


Recipe = DelayedScaling | CurrentScaling | MXFP8BlockScaling | NVFP4BlockScaling
_RECIPES = (DelayedScaling, CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling)
