"""Compressed collectives over any torch.distributed process group."""

from typing import Any

from lowbit.comm.allreduce import (AlgorithmPlugin, CommStats, Handle, algorithm_choices, algorithms, all_reduce,
                                   bytes_sent_per_rank, get_algorithm, register_algorithm)
from lowbit.comm.collectives import CollectiveError
from lowbit.comm import hierarchical  # registers algorithm="hierarchical" (lowbit.comm.allreduce.register_algorithm)

__all__ = ["ALGORITHMS", "AlgorithmPlugin", "CollectiveError", "CommStats", "Handle", "algorithm_choices", "algorithms",
           "all_reduce", "bytes_sent_per_rank", "get_algorithm", "hierarchical", "register_algorithm"]


def __getattr__(name: str) -> Any:
    # ALGORITHMS: the registry's choices when asked for (plugins register theirs after this import)
    if name == "ALGORITHMS":
        return algorithm_choices()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
