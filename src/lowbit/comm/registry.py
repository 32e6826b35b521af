"""The registry of collective algorithms: every algorithm, lowbit's own and any plugin's, is one entry.

An entry (:class:`AlgorithmPlugin`) says how to run one reduction (``start``) and what it sends
(``bytes_per_rank``); :func:`lowbit.comm.allreduce.start` runs every call through the entry of the
algorithm it resolves to, and every layer (the DDP hook, the study, the CLI, the speed model) lists and
validates algorithms from here. lowbit's flat algorithms register in :mod:`lowbit.comm.flat`,
``hierarchical`` in :mod:`lowbit.comm.hierarchical`, a plugin in its own module named in
``$LOWBIT_PLUGINS`` (docs/codecs.md, "Your own algorithm"). What an algorithm costs on a network is the
speed model's business (:mod:`lowbit.lab.perfmodel.collectives`); a plugin may bring its own ``cost``.

``auto`` is not an entry: :func:`resolve_algorithm` turns it into one per call, by one rule
(:func:`auto_algorithm`) that the collectives, the DDP hook and the speed model share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowbit.codecs.base import Codec, load_plugins

__all__ = ["AUTO", "SIMULATED", "AlgorithmPlugin", "Call", "register_algorithm", "algorithms", "algorithm_choices",
           "get_algorithm", "AUTO_TWO_RANKS_SCATTER_FROM", "auto_algorithm", "resolve_algorithm"]

#: The name that is not an algorithm but picks one per call (:func:`resolve_algorithm`).
AUTO = "auto"

#: Grubic et al.'s simulation of low-precision NCCL (Figs 7, 9, 11): a native fp32 allreduce of a buffer cut
#: to bits/32 of the tensor. Speed only: the tensor is NOT reduced (each rank keeps its own values).
SIMULATED = "simulated"


@dataclasses.dataclass
class Call:
    """One reduction, as an algorithm's ``start`` receives it (:func:`lowbit.comm.allreduce.start` builds
    it): reduce ``x`` ((n + exact,) float32) over ``group`` into ``out`` and return the future of ``out``
    (of ``post()`` when given). ``op``: "sum" or "mean"; ``residual``: error feedback ((n,) float32,
    updated in place: ``x + residual`` is sent); ``seed``: the call's rounding seed; ``stats``: where the
    bytes go (the call itself is already counted, once, by ``start``); ``node_size``: ranks per node
    (``hierarchical``); ``shape``: the shape of the first n values, for per-tensor codecs; ``world``:
    (rank, size) in ``group``; ``exact``: the last ``exact`` values ride raw in fp32 (entries with
    ``exact=True`` only)."""

    x: torch.Tensor
    codec: Codec
    group: dist.ProcessGroup | None
    op: str
    out: torch.Tensor
    world: tuple[int, int]
    residual: torch.Tensor | None = None
    seed: int = 0
    stats: Any = None
    post: Callable[[], torch.Tensor] | None = None
    node_size: int | None = None
    shape: tuple[int, ...] | None = None
    exact: int = 0

    def finished(self) -> torch.Tensor:
        """What the call's future holds: ``post()`` when given, else ``out``."""
        return self.out if self.post is None else self.post()


@dataclasses.dataclass(frozen=True)
class AlgorithmPlugin:
    """One collective algorithm: an entry of the registry that every layer reads (:func:`register_algorithm`,
    :func:`algorithms`). lowbit's own algorithms are entries like any other (:mod:`lowbit.comm.flat`,
    :mod:`lowbit.comm.hierarchical`), and a new algorithm is one more, in a module of its own
    (``tests/plugins/toy_algorithm.py``; docs/codecs.md, "Your own algorithm").

    ``start(call)`` issues one reduction (a :class:`Call`: ``call.x`` into ``call.out``) and returns the
    future of ``call.finished()``, as :func:`lowbit.comm.allreduce.start` does, the call already counted
    in ``call.stats`` (an algorithm that runs another through :func:`lowbit.comm.allreduce.run` does not
    count it again).
    ``bytes_per_rank(codec, n, k, rank, exact, node_size, shape)`` is what rank ``rank`` sends for one call
    of ``n`` values. ``prepare(group, node_size)`` resolves, once per call before the ranks agree, what they
    must agree on (hierarchical: the node size); ``None``: nothing.

    ``flat``: an algorithm over the whole group that :func:`resolve_algorithm` may pick or stand in for: a
    call names it or ``auto``, and codecs that sum on the wire run ``allreduce``, per-tensor codecs
    ``allgather`` whatever was named; it runs for one rank too. Not flat (the default, a plugin's):
    ``start`` gets every call of more than one rank that names it, whatever the codec, and a one-rank call
    runs the flat ``allgather``. ``exact``: ``start`` also takes calls with ``call.exact = m``, the last
    ``m`` values of ``x`` riding raw in fp32 (the DDP hook's small tensors, in allgather's message); other
    entries refuse them.

    For the speed model (``None``: lowbit.lab.perfmodel's own formulas for lowbit's algorithms
    (:mod:`lowbit.lab.perfmodel.collectives`), else the algorithm is not modelled): ``cost(nbytes, topo,
    fp32_bytes)`` is a :class:`lowbit.lab.perfmodel.collectives.CommCost` (seconds, bytes sent per rank,
    steps) for a payload of ``nbytes`` per rank in the codec's precision on a
    :class:`lowbit.lab.perfmodel.collectives.Topology` (world size, ranks per node, links), ``fp32_bytes``
    being the uncompressed size when the payload is compressed (None when it is fp32);
    ``work(numel, world, gpus_per_node)`` gives the values ``(encoded, decoded)`` per rank for one call of
    ``numel`` values (default ``(numel, numel)``).

    ``quantised``: takes quantised codecs (False: only codecs that sum on the wire, as ``allreduce``).
    ``multi_node``: meant for clusters of several nodes (``lowbit advise --algorithm auto`` tries it only
    there). ``doc``: one line for listings.
    """

    start: Callable[..., torch.futures.Future] | None = None
    bytes_per_rank: Callable[..., int] | None = None
    prepare: Callable[[dist.ProcessGroup | None, int | None], int | None] | None = None
    cost: Callable[..., Any] | None = None
    work: Callable[[float, int, int], tuple[float, float]] | None = None
    quantised: bool = True
    multi_node: bool = False
    flat: bool = False
    exact: bool = False
    doc: str = ""


_PLUGINS: dict[str, AlgorithmPlugin] = {}


def register_algorithm(name: str, plugin: AlgorithmPlugin) -> None:
    """Make ``name`` an algorithm of :func:`lowbit.all_reduce`, the DDP hook, the study, the CLI
    and (with a ``cost``) the speed model: every layer validates and lists algorithms from this registry.
    Registering a name again replaces its entry. Name a module that calls this in ``$LOWBIT_PLUGINS`` so
    that every process, spawned workers included, registers it."""
    if not isinstance(name, str) or not name.isidentifier() or name == AUTO:
        raise ValueError(f"register_algorithm: the name must be an identifier other than {AUTO!r}, got {name!r}")
    if not isinstance(plugin, AlgorithmPlugin):
        raise ValueError(f"register_algorithm: {name!r} needs an AlgorithmPlugin, got {type(plugin).__name__}")
    if plugin.start is None or plugin.bytes_per_rank is None:
        raise ValueError(f"register_algorithm: {name!r} needs its start and bytes_per_rank")
    _PLUGINS[name] = plugin


def algorithms() -> tuple[str, ...]:
    """Every registered algorithm (the built-ins, then those of ``$LOWBIT_PLUGINS``), in registration order;
    ``auto`` is not one of them (:func:`algorithm_choices`)."""
    load_plugins()
    return tuple(_PLUGINS)


def algorithm_choices() -> tuple[str, ...]:
    """What ``algorithm=`` accepts: ``auto`` and every registered algorithm."""
    return (AUTO,) + algorithms()


def get_algorithm(name: str) -> AlgorithmPlugin:
    """The registry's entry of ``name``; a ValueError naming the known algorithms when there is none."""
    plugin = _PLUGINS.get(name) if isinstance(name, str) else None
    if plugin is None:
        names = algorithms()  # (loads $LOWBIT_PLUGINS: the name may be one of theirs)
        plugin = _PLUGINS.get(name) if isinstance(name, str) else None
        if plugin is None:
            raise ValueError(f"unknown algorithm {name!r}; choose one of {list((AUTO,) + names)}")
    return plugin


#: ``auto`` for two ranks: from how many values scatter_gather beats allgather, per device type of the tensor
#: (None: at no size). With two ranks both send the same bytes in different shapes: allgather one exchange of
#: whole payloads and one decode-and-sum of both, scatter_gather two exchanges of half payloads and three
#: smaller decodes. Measured on 2 ranks (docs/bench.md, "Which algorithm auto runs"): on CUDA (NCCL, NVLink
#: and sockets) allgather at every size, 1M to 256M values. On the 2-core CPU VM (gloo over loopback, numba
#: kernels) it depends on the codec: at 16M values allgather's decode-and-sum took 66-76 ms for QSGD against
#: scatter_gather's three decodes' 85-102 ms, but 405 ms against 171 ms for 1bitSGD*. 4- and 2-bit QSGD ran
#: 3-35 % faster with allgather up to 16M values, 8-bit QSGD with allgather up to 2M, within 7 % at 4M-8M and
#: 5-13 % faster with scatter_gather at 16M (gloo's all-gather of a 16 MB message is slow); 1bitSGD* ran 2-14 %
#: faster with scatter_gather at 2M-4M and 29-34 % at 8M-16M. From 8M values on, scatter_gather lost 3-16 %
#: where it lost (29 % once) and won 5-34 % where it won: the CPU's threshold.
AUTO_TWO_RANKS_SCATTER_FROM: dict[str, int | None] = {"cpu": 1 << 23, "cuda": None}


def auto_algorithm(k: int, numel: int | None = None, device: torch.device | str | None = None) -> str:
    """The flat algorithm ``auto`` runs for a quantised codec on ``k`` ranks: ``scatter_gather`` above two
    ranks (its bytes per rank stay ~2 payloads as K grows, allgather's grow as K-1); for two ranks
    ``allgather`` (one exchange), unless the tensor's device type has a size from which scatter_gather was
    measured faster (:data:`AUTO_TWO_RANKS_SCATTER_FROM`) and ``numel`` reaches it. Without ``numel`` or
    ``device`` (a caller that does not know them) two ranks take allgather. The one rule of ``auto``: the
    collectives, the DDP hook and the speed model (:func:`lowbit.lab.perfmodel.model.resolve_algorithm`) all
    resolve it here."""
    if k > 2:
        return "scatter_gather"
    if k < 2 or numel is None or device is None:
        return "allgather"
    start_at = AUTO_TWO_RANKS_SCATTER_FROM.get(torch.device(device).type)
    return "scatter_gather" if start_at is not None and numel >= start_at else "allgather"


def resolve_algorithm(algorithm: str, codec: Codec, k: int, numel: int | None = None,
                      device: torch.device | str | None = None) -> str:
    """The algorithm a call really runs: native allreduce for codecs that sum on the wire; ``auto`` is
    :func:`auto_algorithm` for ``k`` ranks and a tensor of ``numel`` values on ``device`` (allgather for
    two ranks unless measured otherwise for that device and size, scatter_gather above); ``hierarchical``
    stays itself (it picks its between-node algorithm the same way). Per-tensor codecs
    (``codec.per_tensor``: per-column 1bitSGD, Dettmers with one scale) always take ``allgather``."""
    if algorithm == SIMULATED:
        return SIMULATED  # any codec: only its bits per value matter
    if codec.sums_on_wire:
        return "allreduce"
    if codec.per_tensor:
        return "allgather"  # a tensor's own groups cannot be cut into chunks
    if algorithm == "auto":
        return auto_algorithm(k, numel, device)
    return algorithm


def resolve_entry(algorithm: str, codec: Codec, k: int, numel: int | None = None,
                  device: torch.device | str | None = None) -> tuple[str, AlgorithmPlugin]:
    """The entry that runs a call naming ``algorithm``: a non-flat entry as named for more than one rank,
    else the flat entry :func:`resolve_algorithm` gives (for one rank, allgather in place of a non-flat
    one). A ValueError names an unknown algorithm."""
    if algorithm != AUTO:
        entry = get_algorithm(algorithm)
        if not entry.flat and k > 1:
            return algorithm, entry
    name = resolve_algorithm(algorithm, codec, k, numel, device)
    entry = get_algorithm(name)
    if not entry.flat:  # one rank: nothing crosses the wire, and a plugin is not called for it
        name, entry = "allgather", get_algorithm("allgather")
    return name, entry
