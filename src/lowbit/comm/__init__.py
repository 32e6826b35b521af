"""Compressed collectives over any torch.distributed process group."""

from lowbit.comm.allreduce import ALGORITHMS, CommStats, Handle, all_reduce, bytes_sent_per_rank
from lowbit.comm.collectives import CollectiveError
from lowbit.comm import hierarchical  # registers algorithm="hierarchical" (lowbit.comm.allreduce.register_algorithm)

__all__ = ["ALGORITHMS", "CollectiveError", "CommStats", "Handle", "all_reduce", "bytes_sent_per_rank", "hierarchical"]
