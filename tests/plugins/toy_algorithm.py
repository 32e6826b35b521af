"""A collective algorithm written outside lowbit, in one file: ``toy_ring``, one registry entry.

Every rank encodes its whole tensor once (error feedback on what it sent), all-gathers every rank's
payload, and decodes their sum in rank order (so every rank ends with the same bits). What the
extensibility test registers through ``LOWBIT_PLUGINS=tests.plugins.toy_algorithm``: how to run it
(``start``), what it sends (``bytes_per_rank``), and for the speed model its cost and the values it
encodes and decodes; ``lowbit.all_reduce``, the DDP hook, the study, the CLI and ``lowbit predict``
read it from the registry.
"""

from __future__ import annotations

import torch

from lowbit.comm import collectives as C
from lowbit.comm.allreduce import AlgorithmPlugin, Call, register_algorithm
from lowbit.lab.perfmodel.collectives import CommCost, Topology, ring_allgather

NAME = "toy_ring"
CALLS = 0  # reductions this process ran with it (the test reads it in its workers)


def _start(call: Call) -> torch.futures.Future:
    global CALLS
    CALLS += 1
    x, codec, group, op, residual, seed, stats, out, post, shape = (
        call.x, call.codec, call.group, call.op, call.residual, call.seed, call.stats, call.out, call.post, call.shape)
    rank, k = call.world
    n = x.numel()
    if n == 0:
        return C.done(out if post is None else post(), x.device)
    shape = shape if shape is not None else codec.flat_shape(n)
    comp = x if residual is None else x + residual
    payload = codec.encode(comp.view(shape) if shape is not None else comp, seed=(seed * 1_000_003 + rank) & 0x7FFFFFFF)
    if residual is not None:  # error feedback: what this rank did not send joins its next call
        codec.decode(payload, n, out=residual, shape=shape)
        torch.sub(comp, residual, out=residual)
    p = payload.numel()
    recv = torch.empty(k * p, dtype=torch.uint8, device=x.device)
    work = C.all_gather_async(recv, payload, group)
    if stats is not None:
        stats.bytes_sent += (k - 1) * p

    def finish() -> torch.Tensor:
        codec.decode_sum([recv[i * p : (i + 1) * p] for i in range(k)], n, out=out, shape=shape,
                         divide_by=k if op == "mean" else 1)
        return out if post is None else post()

    return C.then(work, finish, "all_gather_into_tensor", group)


def _bytes(codec, n, k, rank, exact, node_size, shape) -> int:  # noqa: ANN001
    if exact:
        raise ValueError(f"{NAME} carries no exact values")
    return (k - 1) * codec.nbytes(n, shape if shape is not None else codec.flat_shape(n))


def _cost(nbytes: float, topo: Topology, fp32_bytes: float | None = None) -> CommCost:
    return ring_allgather(nbytes, topo)  # every rank's whole payload to every rank


def _work(n: float, k: int, g: int) -> tuple[float, float]:
    return n, k * n  # one encode, K decodes


register_algorithm(NAME, AlgorithmPlugin(start=_start, bytes_per_rank=_bytes, cost=_cost, work=_work,
                                         doc="toy: all-gather every rank's payload, decode the sum"))
