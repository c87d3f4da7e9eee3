"""The names mpjax has deprecated, and the release that removes them: one registry, which the
warnings, the changelog and the API page's table are checked against (tests/test_package.py)."""

from __future__ import annotations

# The 0.x rule (docs/changelog.md): a name deprecated in 0.N works, with a FutureWarning,
# through 0.N and is removed in 0.(N+1).
REMOVED_IN = "0.2.0"

# old name (as a user writes it) -> the name to use instead
DEPRECATED: dict[str, str] = {}


def deprecate(old: str, new: str) -> str:
    """Records `old` as deprecated for `new`; returns the warning's text.

    Example:
      >>> from mpjax._src.deprecations import deprecate
      >>> deprecate("mpjax.example_old", "mpjax.example_new").endswith("mpjax 0.2.0.")
      True
    """
    DEPRECATED[old] = new
    return f"{old} is renamed {new} (one name per job); {old} is removed in mpjax {REMOVED_IN}."
