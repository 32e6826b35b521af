"""Model parallelism with low-precision activations (Dettmers 2016, section 3).

* :class:`ColumnParallelLinear`, :func:`parallelize`: linear layers whose output features are split over
  the ranks; activations gathered forward and activation gradients summed backward in any lowbit codec
  (default Dettmers' dynamic tree 8-bit, one scale per tensor).
* :class:`RowParallelLinear` (``parallelize(..., pair=True)``): the second of a pair of linear layers
  takes the first's output slice and sums partial outputs with one all-reduce (half the transfers).
* :class:`Hybrid`: convolutions data-parallel, fully connected layers model-parallel, the activations
  between them in sub-batches whose transfers overlap the compute of the previous one.

The collectives underneath are :func:`lowbit.comm.gather.all_gather` and
:func:`lowbit.comm.gather.reduce_scatter`. docs/parallel.md shows both in use.
"""

from lowbit.parallel.hybrid import Hybrid
from lowbit.parallel.layers import (
    DEFAULT_CODEC,
    ColumnParallelLinear,
    ParallelComm,
    RowParallelLinear,
    SharedDropout,
    copy_to_parallel,
    gather_features,
    parallelize,
    reduce_features,
)
from lowbit.parallel.split import PARALLELISMS, check_splits, hybrid_parts, model_parallel_chain

__all__ = ["DEFAULT_CODEC", "PARALLELISMS", "ColumnParallelLinear", "Hybrid", "ParallelComm", "RowParallelLinear",
           "SharedDropout", "check_splits", "copy_to_parallel", "gather_features", "hybrid_parts",
           "model_parallel_chain", "parallelize", "reduce_features"]
