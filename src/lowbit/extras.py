"""Optional dependencies: one place that names the extra to install when one is missing.

    sklearn = require("sklearn", "study", "the digits data set")

raises :class:`MissingExtra` (a ValueError, so every ``lowbit`` command reports it in one line and exits
with 2) saying ``pip install 'lowbit[study]'``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtra", "require"]

#: Import names whose package on PyPI is called otherwise (``pip install sklearn`` is a deprecated
#: placeholder that fails on purpose).
_DISTRIBUTION = {"sklearn": "scikit-learn", "PIL": "pillow", "yaml": "pyyaml"}


class MissingExtra(ValueError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtra` naming ``extra`` and what needed it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        dist = _DISTRIBUTION.get(top, top)
        raise MissingExtra(f"{what} needs the '{top}' module, which is not installed: pip install "
                           f"'lowbit[{extra}]' (or pip install {dist})") from exc
