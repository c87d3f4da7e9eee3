"""mpjax internals, by part: interpreter/, tools/, scaling/, optim/, float8/. Import from
`mpjax` instead."""

from typing import Any


def __getattr__(name: str) -> Any:
    """jmp's private module names that mpjax keeps in a subpackage, for ``from jmp._src import
    loss_scale`` under ``sys.modules["jmp"] = mpjax`` (see jmp_alias)."""
    if name == "loss_scale":
        from mpjax._src.scaling import loss_scale

        return loss_scale
    raise AttributeError(f"module 'mpjax._src' has no attribute {name!r}")
