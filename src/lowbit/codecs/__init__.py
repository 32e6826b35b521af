"""Codecs: pure tensor <-> payload transforms (no communication, no state). See :mod:`lowbit.codecs.base`.

Every module of this package but the contract (``base``) defines codecs that register themselves on
import, and is imported here: a new built-in codec is its file (and its kernels), with nothing to add to a
list. (The ``lowbit codecs`` table that measures them is the lab's: :mod:`lowbit.lab.codec_report`.)
"""

import importlib
import pkgutil

from lowbit.codecs.base import Codec, available_codecs, get_codec, parse_spec, register_codec

__all__ = ["Codec", "available_codecs", "get_codec", "parse_spec", "register_codec"]

#: Modules of this package that are not codecs.
NOT_CODECS = ("base",)

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod not in NOT_CODECS and not _mod.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod}")
del _mod
