"""Under ``sys.modules["jmp"] = mpjax``, jmp's private modules are mpjax's own.

Public code imports from jmp's private modules (``from jmp._src.policy import
_cast_floating_to``, ``from jmp._src import loss_scale``). With mpjax standing in for jmp,
Python would load mpjax's files a second time under those names, with classes distinct
from mpjax's (``isinstance(x, jmp.DynamicLossScale)`` false for a loss scale made through
the alias). This finder gives ``jmp._src`` and ``jmp._src.<name>`` the modules mpjax
already loaded, and only while ``jmp`` is mpjax.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

_JMP_SRC = "jmp._src"
# jmp's private modules that mpjax keeps in a subpackage (jmp._src.policy is mpjax's policy).
_MOVED = {".loss_scale": ".scaling.loss_scale"}


class _Existing(importlib.abc.Loader):
    """Loads a module that is already loaded: mpjax's own, under jmp's name."""

    def __init__(self, module: Any):
        self.module = module

    def create_module(self, spec: Any) -> Any:
        return self.module

    def exec_module(self, module: Any) -> None:
        pass


class _JmpSrcFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not (fullname == _JMP_SRC or fullname.startswith(_JMP_SRC + ".")):
            return None
        if sys.modules.get("jmp") is not sys.modules.get("mpjax"):
            return None  # jmp itself, or no jmp: the usual import
        try:
            rest = fullname[len(_JMP_SRC) :]
            module = importlib.import_module("mpjax._src" + _MOVED.get(rest, rest))
        except ImportError:
            return None
        return importlib.util.spec_from_loader(fullname, _Existing(module))


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _JmpSrcFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JmpSrcFinder())
