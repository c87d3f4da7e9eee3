"""What a level means: the names mpjax accepts for O0-O3, and one row per level of every
decision that depends on it, from what :meth:`Policy.from_level` builds to what autocast does.

No other module compares a level: each asks :func:`of` for the policy's row and reads the
decision by name. A policy from jmp's grammar (no level) gets :data:`PLAIN`, whose row states
what such a policy does (its own op lists, no level's extras). Changing what "O2 but not O1"
means is changing a cell of :data:`LEVEL_ROWS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

LEVELS = ("O0", "O1", "O2", "O3")

# Every level name mpjax accepts (any case, as Paddle's upper()) -> its mpjax level. apex,
# Paddle and MindSpore share O0-O3; MindSpore's auto_mixed_precision(net, "auto") runs the
# white list in half, the black list in float32 and the rest in their widest input: O1.
LEVEL_NAMES: dict[str, str] = {"O0": "O0", "O1": "O1", "O2": "O2", "O3": "O3", "auto": "O1"}
_LEVEL_KEYS = {name.upper(): level for name, level in LEVEL_NAMES.items()}
ACCEPTED = ", ".join(f"'{name}'" for name in LEVEL_NAMES)

# Peer names that mean no mpjax level: each refusal says why and what comes closest.
_UNMAPPED_LEVELS = {
    "OD": (
        "Paddle's 'OD' (like MindSpore's own 'O1') runs only the white list (matmul, conv) in "
        "half and every other op in float32, and mpjax has no such level. The closest is 'O1', "
        "where ops outside both lists follow their inputs."
    ),
    "AUTOCAST": (
        "torch has no level names, but torch.autocast's rule is mpjax's 'O1' (lower list in "
        "half, float32 list in float32, the rest in their widest input)."
    ),
}


def check_name(level: object) -> str:
    """The mpjax level a level name means ("auto" -> "O1", any case), or an error that says
    what the name is (a peer's level mpjax has no twin for, a zero for the letter O)."""
    if not isinstance(level, str):
        raise TypeError(
            f"level must be a string such as 'O2', got {type(level).__name__} {level!r}."
        )
    key = level.strip().upper()
    if key in _LEVEL_KEYS:
        return _LEVEL_KEYS[key]
    if key in _UNMAPPED_LEVELS:
        raise ValueError(
            f"Level {level!r} is not accepted: {_UNMAPPED_LEVELS[key]} Accepted level names "
            f"(any case): {ACCEPTED}."
        )
    hint = ""
    if key.startswith("0") and key[1:] in ("0", "1", "2", "3"):
        hint = f" Did you mean 'O{key[1:]}' (the letter O, as in apex)?"
    raise ValueError(
        f"Unknown level {level!r}: use one of {ACCEPTED} (any case); 'auto' is MindSpore's "
        f"name for O1.{hint}"
    )


def names_a_level(text: str) -> bool:
    """Whether `text` is a level's name, accepted or refused with a reason (Paddle's "OD")."""
    key = text.strip().upper()
    return key in _LEVEL_KEYS or key in _UNMAPPED_LEVELS


@dataclasses.dataclass(frozen=True)
class Level:
    """One level's meaning. The first fields are what ``Policy.from_level`` builds, the rest
    what autocast does at the level when the policy computes in half (see :func:`casts`)."""

    name: str | None
    # -- what from_level builds ---------------------------------------------------------------
    # Compute in the half dtype (O0: everything in float32).
    computes_half: bool
    # The default float32 op list applies (O3 empties it: every op in half).
    f32_list: bool
    # keep_norm_fp32's default.
    norms_f32: bool
    # Options that mean nothing at the level, and why (apex raises likewise).
    refuses: Mapping[str, str]
    # -- what autocast does -------------------------------------------------------------------
    # Autocast rewrites the function (O0 returns it as it is).
    interprets: bool
    # An op on neither list follows its widest strong input, as torch.autocast's promote
    # list, and a matmul's bias add stays half (O1); else it follows the casts it commutes
    # with (O2, O3).
    per_op: bool
    # The model is cast to half, as apex casts it (O2, O3): params reach the ops in half, so a
    # lookup in a param table takes its rows in half even where a float32 op takes them.
    casts_model: bool
    # The program runs as if written in half (O3): every param in half, params stored in half
    # (unless master_weights=True), output in half, fills beyond the half's range clamped.
    all_half: bool
    # Sums the backward pass makes of a broadcast half activation, and a half lookup's
    # scatter-add, run in float32 (O1, O2).
    widens_activation_sums: bool


_O0_REFUSES = dict.fromkeys(
    ("lower_ops", "f32_ops", "master_weights"),
    "O0 runs everything in float32. Pick O1 or O2 to use half.",
)
_O0_REFUSES["keep_norm_fp32=False"] = "O0 runs everything in float32."

_O1_REFUSES = {
    "master_weights": "O1 already stores float32 params and casts per op; use O2 for float32 "
    "master weights with half compute."
}
_O3_REFUSES = {"lower_ops": "O3 already runs every op in half."}

LEVEL_ROWS: Mapping[str, Level] = {
    "O0": Level(
        "O0",
        computes_half=False,
        f32_list=True,
        norms_f32=True,
        refuses=_O0_REFUSES,
        interprets=False,
        per_op=False,
        casts_model=False,
        all_half=False,
        widens_activation_sums=False,
    ),
    "O1": Level(
        "O1",
        computes_half=True,
        interprets=True,
        f32_list=True,
        norms_f32=True,
        refuses=_O1_REFUSES,
        per_op=True,
        casts_model=False,
        all_half=False,
        widens_activation_sums=True,
    ),
    "O2": Level(
        "O2",
        computes_half=True,
        interprets=True,
        f32_list=True,
        norms_f32=True,
        refuses={},
        per_op=False,
        casts_model=True,
        all_half=False,
        widens_activation_sums=True,
    ),
    "O3": Level(
        "O3",
        computes_half=True,
        interprets=True,
        f32_list=False,
        norms_f32=False,
        refuses=_O3_REFUSES,
        per_op=False,
        casts_model=True,
        all_half=True,
        widens_activation_sums=False,
    ),
}

# A policy with no level (jmp's grammar, Policy(...)): its own op lists, none of a level's
# extras; autocast rewrites it, and a half compute dtype casts as the lists say.
PLAIN = Level(
    None,
    computes_half=True,
    interprets=True,
    f32_list=False,
    norms_f32=False,
    refuses={},
    per_op=False,
    casts_model=False,
    all_half=False,
    widens_activation_sums=False,
)


class _Policy(Protocol):
    """What :func:`of` reads of a policy (policy.py imports this module, not the reverse)."""

    @property
    def level(self) -> str | None: ...

    @property
    def half(self) -> bool: ...


def of(policy: _Policy) -> Level:
    """The row of `policy`'s level (:data:`PLAIN` for a policy with none)."""
    return PLAIN if policy.level is None else LEVEL_ROWS[policy.level]


def casts(policy: _Policy) -> bool:
    """Whether `policy` runs anything in half: it computes in half at a level that rewrites
    the function (not O0). A policy that does not does nothing to a function's dtypes."""
    return policy.half and of(policy).interprets
