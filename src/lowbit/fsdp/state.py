"""lowbit.fsdp's state: what :func:`lowbit.fsdp.register` returns (configuration, statistics, residuals)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lowbit.auto.fsdp_tuner import FSDPAuto
from lowbit.codecs.base import Codec
from lowbit.comm import graphs
from lowbit.comm.allreduce import CommStats
from lowbit.feedback import ErrorFeedback
from lowbit.policy import Policy

# ------------------------------------------------------------------------------------------ state
class FSDPState:
    """What :func:`register` returns: the configuration, statistics and error-feedback residuals.

    ``stats`` (:class:`lowbit.comm.CommStats`) counts calls and the bytes this rank put on the wire
    (``bytes_inter``: of those, what crossed nodes, with ``node_size`` splitting the group; for FSDP's own
    reduce-scatter, ``codec="auto"``'s native choice, the chunks of this rank's gradient that go to ranks
    on other nodes, ``(K - node_size) x S`` values: what its algorithm (NCCL's ring, say) routes between
    nodes is its own); ``grad_stats`` and ``param_stats`` split them by direction. ``state_dict()`` / ``load_state_dict()`` carry the residuals (per rank) through checkpoints.
    With ``codec="auto"``, ``codec`` is None and ``auto`` (:class:`lowbit.auto.fsdp_tuner.FSDPAuto`) holds what
    each module runs and why; checkpoints carry it too.
    """

    def __init__(self, codec: Codec | None, param_codec: Codec | None, error_feedback: bool, policy: Policy | None,
                 node_size: int | None, replicate_group: dist.ProcessGroup | None, rank: int, world_size: int,
                 device: torch.device) -> None:
        self.codec = codec
        self.param_codec = param_codec
        self.error_feedback = error_feedback
        self.policy = policy
        self.node_size = node_size
        self.replicate_group = replicate_group
        self.rank, self.world_size, self.device = rank, world_size, device
        self.grad_stats = CommStats()
        self.param_stats = CommStats()
        self.feedback = ErrorFeedback(codec) if error_feedback else None
        self.modules: list[str] = []
        self.iter = 0  # reduce-scatter calls (keys the gradient codec's rounding noise)
        self.auto: FSDPAuto | None = None
        # what a checkpoint's residuals are checked against (register fills them in): module -> ranks of
        # its compressed exchange (a residual (module, S) holds that many rows of S), module -> the values
        # of its HSDP all-reduce's residual, and the residuals every checkpoint of this state holds
        self._feedback_ranks: dict[str, int] = {}
        self._replicate_numels: dict[str, int] = {}
        self._required: tuple[Any, ...] = ()
        # CUDA graphs of the two directions' exchanges (lowbit.comm.graphs), shared by the modules
        self.grad_graphs = graphs.Graphs("lowbit.fsdp reduce-scatter")
        self.param_graphs = graphs.Graphs("lowbit.fsdp all-gather")

    @property
    def stats(self) -> CommStats:
        g, p = self.grad_stats, self.param_stats
        return CommStats(calls=g.calls + p.calls, bytes_sent=g.bytes_sent + p.bytes_sent,
                         bytes_inter=g.bytes_inter + p.bytes_inter)

    def config(self) -> dict[str, Any]:
        out = {"codec": "auto" if self.codec is None else self.codec.spec,
               "param_codec": None if self.param_codec is None else self.param_codec.spec,
               "error_feedback": self.error_feedback, "policy": None if self.policy is None else self.policy.fingerprint(),
               "node_size": self.node_size, "replicate": self.replicate_group is not None, "modules": self.modules}
        if self.auto is not None:
            out["auto"] = self.auto.config()
        return out

    def state_dict(self) -> dict[str, Any]:
        out = {"config": self.config(), "rank": self.rank, "world_size": self.world_size, "iter": self.iter,
               "feedback": None if self.feedback is None else self.feedback.state_dict()}
        if self.auto is not None:
            out["auto"] = self.auto.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()``'s checkpoint: every entry is checked before any is loaded (a ``ValueError``
        leaves this state as it was). Each rank loads its own (the residuals, and ``iter`` and the auto
        tuner's step count, are per rank): every rank must load, or none; with ``codec="auto"``, ranks of
        which only some loaded a decision would hang at the first collective the others still measure with."""
        if not isinstance(state, dict):
            raise ValueError(f"lowbit.fsdp checkpoint must be a dict (from state_dict()), got {type(state).__name__}")
        for key in ("config", "rank", "world_size", "iter", "feedback"):
            if key not in state:
                raise ValueError(f"lowbit.fsdp checkpoint has no {key!r} entry (not made by FSDPState.state_dict())")
        if state["config"] != self.config():
            raise ValueError(f"lowbit.fsdp checkpoint was saved with {state['config']}, but this state is {self.config()}")
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"lowbit.fsdp checkpoint belongs to rank {state['rank']} of {state['world_size']}, "
                             f"not rank {self.rank} of {self.world_size} (residuals differ between ranks)")
        it = state["iter"]
        if isinstance(it, bool) or not isinstance(it, int) or not 0 <= it < 2**62:
            raise ValueError(f"lowbit.fsdp checkpoint: iter must be a non-negative int below 2**62, got {it!r}")
        if (state["feedback"] is None) != (self.feedback is None):
            raise ValueError("lowbit.fsdp checkpoint and this state disagree on error feedback")
        load_auto = self.auto.loader(state.get("auto")) if self.auto is not None else None
        feedback = None
        if self.feedback is not None:  # checked on a copy: nothing loads unless everything fits
            feedback = ErrorFeedback(self.feedback.codec)
            saved = state["feedback"].get("residuals") if isinstance(state["feedback"], dict) else None
            feedback.load_state_dict(state["feedback"], device=self.device,
                                     numels=self._residual_numels(saved if isinstance(saved, dict) else ()),
                                     required=self._required)
        if load_auto is not None:  # first: a module whose choice changes drops its residual
            load_auto()
        if feedback is not None:
            self.feedback.residuals = feedback.residuals
        self.iter = it
        self.grad_graphs.clear()  # their residuals moved


    def _residual_numels(self, keys: Any) -> dict[Any, int]:
        """Of ``keys`` (a checkpoint's residuals), those this state may hold, with their sizes: (module, S)
        of a module whose reduce-scatter may keep error feedback, N x S values (N: the ranks of its
        compressed exchange); ("replicate", module), HSDP's all-reduce of the module's shard."""
        out = {}
        for key in keys:
            if isinstance(key, tuple) and len(key) == 2:
                name, s = key
                if isinstance(s, int) and not isinstance(s, bool) and s >= 0 and name in self._feedback_ranks:
                    out[key] = self._feedback_ranks[name] * s
                elif name == "replicate" and s in self._replicate_numels:
                    out[key] = self._replicate_numels[s]
        return out
