"""The names mpjax has deprecated, and the release that removes them: one registry, which the
warnings, the changelog and the API page's table are checked against (tests/test_package.py)."""

from __future__ import annotations

import warnings
from typing import Any

# The 0.x rule (docs/changelog.md): a name deprecated in 0.N works, with a FutureWarning,
# through 0.N and is removed in 0.(N+1).
REMOVED_IN = "0.2.0"

# old name (as a user writes it) -> the name to use instead
DEPRECATED: dict[str, str] = {}


def deprecate(old: str, new: str) -> str:
    """Records `old` as deprecated for `new`; returns the warning's text.

    Example:
      >>> import mpjax
      >>> from mpjax._src.deprecations import DEPRECATED
      >>> DEPRECATED["mpjax.value_and_grad"]
      'mpjax.scaled_value_and_grad'
    """
    DEPRECATED[old] = new
    return f"{old} is renamed {new} (one name per job); {old} is removed in mpjax {REMOVED_IN}."


def renamed(old: str, new: str, fn: Any) -> Any:
    """`fn` under its old public name `old`: it works for one release and warns, once per
    call site, with the new name."""

    message = deprecate(old, new)

    def alias(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(message, FutureWarning, stacklevel=2)
        return fn(*args, **kwargs)

    alias.__name__ = old.rsplit(".", 1)[-1]
    alias.__qualname__ = alias.__name__
    alias.__doc__ = (
        f"Deprecated: renamed :func:`{new}`; this name warns and is removed in mpjax {REMOVED_IN}."
    )
    return alias
