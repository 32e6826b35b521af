"""Ranks agree on their settings before they build anything collective on them.

``register`` (DDP's and FSDP's) is collective: each rank validates its own options, then every rank
compares them with the others' in one all-gather. A rank whose options are refused must still take
part: raising at once, it would leave its peers waiting in that all-gather until the group's timeout,
with a ``CollectiveError`` instead of the reason. So every rank calls :func:`agree` once, with its
settings or with the ``ValueError`` its options raised:

* every rank valid, with the same settings: :func:`agree` returns;
* every rank refused with the same message (one script, one typo): each raises its own ``ValueError``,
  as one process alone would;
* otherwise every rank raises the same :class:`ConfigMismatchError` at once, naming each rank's
  settings or error; on a refused rank it is chained from that rank's ``ValueError`` (``__cause__``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lowbit.comm import collectives as C

__all__ = ["ConfigMismatchError", "agree", "fingerprint"]


class ConfigMismatchError(ValueError):
    """The ranks of a group registered different codecs, policies or algorithms, or some ranks' options
    were refused (the message names each rank's settings or error)."""


def fingerprint(settings: Any) -> str:
    """A short digest of ``settings`` (JSON-able; anything else by its repr), equal on ranks whose
    settings are equal."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def agree(mine: Any, group: dist.ProcessGroup | None, title: str, describe: Callable[[Any], str] = str) -> None:
    """Compare ``mine`` (this rank's settings, or the ``ValueError`` its options raised) across ``group``
    (every rank calls this once, in the same order as its other collectives); raises as the module doc
    says. ``title`` opens a mismatch's message, then one line per rank: ``describe(settings)`` or
    ``invalid: <its error>``."""
    refused = isinstance(mine, ValueError)
    entry = (None, str(mine)) if refused else (fingerprint(mine), mine)
    everyone = C.all_gather_object(entry, group)
    prints = {fp for fp, _ in everyone}  # type: ignore[misc]
    if len(prints) == 1 and None not in prints:
        return
    if prints == {None} and len({msg for _, msg in everyone}) == 1:  # type: ignore[misc]
        raise mine  # every rank made the same mistake: no mismatch, the error itself
    lines = [f"  rank {r}: invalid: {p}" if fp is None else f"  rank {r}: {describe(p)}"
             for r, (fp, p) in enumerate(everyone)]  # type: ignore[misc]
    error = ConfigMismatchError(title + "\n" + "\n".join(lines))
    if refused:
        raise error from mine
    raise error
