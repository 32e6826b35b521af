"""Compressed collectives over any torch.distributed process group."""

from lowbit.comm.allreduce import (AlgorithmPlugin, CommStats, Handle, algorithm_choices, algorithms, all_reduce,
                                   bytes_sent_per_rank, get_algorithm, register_algorithm)
from lowbit.comm.collectives import CollectiveError
from lowbit.comm import hierarchical  # registers algorithm="hierarchical" (lowbit.comm.allreduce.register_algorithm)

__all__ = ["AlgorithmPlugin", "CollectiveError", "CommStats", "Handle", "algorithm_choices", "algorithms",
           "all_reduce", "bytes_sent_per_rank", "get_algorithm", "hierarchical", "register_algorithm"]

