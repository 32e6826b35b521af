"""lowbit.ddp's state: :class:`LowbitState`, the knobs and memory of the comm hook."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from lowbit.auto.ddp_tuner import AutoTuner
from lowbit.choose import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, split_choice
from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm.allreduce import AUTO, CommStats, get_algorithm
from lowbit.comm.groups import new_subgroup
from lowbit.feedback import load_residuals, residuals_state
from lowbit.ddp.config import _FP32, DDPConfig
from lowbit.ddp.messages import _Group, _Layout

log = logging.getLogger("lowbit.ddp")


class _Option:
    """A knob of :class:`LowbitState` that reads ``state.options`` (the one :class:`DDPConfig`); setting
    it replaces the options with a copy that is validated again (the message plan is rebuilt)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: Any, owner: Optional[type] = None) -> Any:
        return self if state is None else getattr(state.options, self.name)

    def __set__(self, state: "LowbitState", value: Any) -> None:
        state.reconfigure(**{self.name: value})


class LowbitState:
    """Knobs and memory of the lowbit DDP comm hook. Pickles without its process group.

    Built by :func:`make_state` / :func:`register` from a :class:`DDPConfig` (``state.options``, whose
    fields ``algorithm``, ``error_feedback``, ``start_iter``, ``seed``, ``message_mb``, ``node_size`` and
    ``hook_thread`` read as attributes here) and the model's parameters: ``plan`` (name -> codec),
    ``params`` (id(parameter) -> name), ``shapes`` and ``devices`` (name -> shape / device), DDP's bucket
    caps (message groups end where DDP's buckets end) and, for ``codec="auto"``, its tuner."""

    algorithm = _Option()
    error_feedback = _Option()
    start_iter = _Option()
    seed = _Option()
    message_mb = _Option()
    node_size = _Option()
    hook_thread = _Option()  # not part of config(): where the host work runs, not what is sent

    def __init__(
        self,
        options: DDPConfig,
        plan: Dict[str, Codec],
        params: Dict[int, str],
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        shapes: Optional[Dict[str, Tuple[int, ...]]] = None,
        devices: Optional[Dict[str, torch.device]] = None,
        bucket_bytes: float = DDP_BUCKET_BYTES,
        first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
        auto: Optional[AutoTuner] = None,
    ) -> None:
        options.check_plan(plan)
        self.process_group = process_group
        self.options = self._resolved(options)
        self.plan = plan                      # parameter name -> codec
        self.algorithms: Dict[str, str] = {}  # parameter name -> its algorithm, where not self.algorithm (auto)
        self.auto = auto                      # codec="auto": its measurements and decision
        self.params = params                  # id(parameter) -> name
        self.order = {name: i for i, name in enumerate(plan)}  # model order of the parameters
        self.policy_fingerprint = options.policy_fingerprint()
        self.iter = 0
        self.residuals: Dict[str, torch.Tensor] = {}
        self.stats = CommStats()
        self._shapes: Dict[str, Tuple[int, ...]] = dict(shapes or {})
        self._numels: Dict[str, int] = {name: math.prod(s) for name, s in self._shapes.items()}
        self._devices: Dict[str, torch.device] = dict(devices or {})
        self._layouts: Dict[Tuple[int, int, int], _Layout] = {}
        self._group_of: Optional[Dict[str, _Group]] = None  # parameter name -> its message group
        self._world: Optional[Tuple[int, int]] = None  # (rank, size), read once
        self._native = False  # set with _world (_refresh_native): the hook runs the fp32 allreduce only
        # DDP's bucket caps, for message_mb="auto" (groups end where DDP's buckets end); register reads
        # them from the DDP model
        self.bucket_bytes = bucket_bytes
        self.first_bucket_bytes = first_bucket_bytes
        # the hook thread's own process group (the same ranks as process_group), made by make_state when
        # the thread may run (open_thread_group): collectives issued during the backward pass on the
        # user's group (by SyncBatchNorm, torch.distributed.nn, DDP itself) cannot interleave with lowbit's
        # differently on different ranks. Not pickled (a restored state falls back to process_group).
        self._thread_group: Optional[dist.ProcessGroup] = None
        self.error: Optional[BaseException] = None  # the first failed collective's error (check())
        self._graphs: Any = None  # the messages' CUDA graphs (lowbit.comm.graphs.Graphs), made on first use
        self._graph_ok: Dict[int, bool] = {}  # id(group) -> whether its calls may be captured
        self._inline_for: Any = None  # (the plan and timing flag _inline was decided for: hooking._inline_pays)
        self._inline = False

    # ------------------------------------------------------------------------------ changes
    def reconfigure(self, **changes: Any) -> None:
        """Replace options (validated again, as :class:`DDPConfig` validates); the message groups are
        planned again at the next compressed bucket."""
        options = dataclasses.replace(self.options, **changes)
        options.check_plan(self.plan)
        self.options = self._resolved(options)
        self._forget_messages()
        self._world = None  # read again (with _native) on the next step

    def _resolved(self, options: DDPConfig) -> DDPConfig:
        """``options`` with what the algorithm needs filled in: ``hierarchical``'s ranks per node, from the
        environment when not given (now: a clear error if unknown)."""
        entry = None if options.algorithm == AUTO else get_algorithm(options.algorithm)
        if entry is not None and entry.prepare is not None and options.node_size is None:
            options = dataclasses.replace(options, node_size=entry.prepare(self.process_group, None))
        return options

    def set_plan(self, assignment: Dict[str, str]) -> None:
        """Make ``assignment`` the plan, as ``codec="auto"`` decides, tries or steps up: parameter name ->
        codec spec, or a spec and the algorithm that tensor goes by (:func:`lowbit.choose.choice`,
        ``"qsgd:bits=8,bucket=512@hierarchical"``); fp32 where absent. Message groups are rebuilt on the
        next bucket; residuals of tensors that keep an error-feedback codec and algorithm are kept, the
        others dropped (a tensor whose codec changes starts empty)."""
        split = {name: split_choice(assignment.get(name, _FP32.spec)) for name in self.plan}
        plan = {name: get_codec(spec) for name, (spec, _) in split.items()}
        algorithms = {name: algo for name, (_, algo) in split.items() if algo}
        for algo in set(algorithms.values()):
            get_algorithm(algo)  # an unknown name: a ValueError naming the known ones
        old = getattr(self, "algorithms", {})
        keep = {n for n, c in plan.items() if self.uses_feedback(c) and self.plan[n].spec == c.spec
                and old.get(n) == algorithms.get(n)}
        self.residuals = {n: v.detach().clone() for n, v in self.residuals.items() if n in keep}
        self.plan = plan
        self.algorithms = algorithms
        self._forget_messages()
        self._refresh_native()

    def count_step(self, step: int) -> None:
        """The step about to run, while lowbit's hook is not installed and so does not count them
        (``codec="auto"`` measuring with DDP's own allreduce)."""
        self.iter = step

    def hook_starts(self, step: int) -> None:
        """lowbit's hook is installed at ``step``: it counts steps from there (compressing from
        ``start_iter`` at the earliest)."""
        self.iter = max(self.iter, step, self.start_iter)

    def open_thread_group(self, module: nn.Module) -> None:
        """Create the hook thread's own process group (a collective ``new_group``: every rank of
        ``process_group`` calls it) where the thread may run and torch.distributed is initialised."""
        if self.wants_thread_group(module) and dist.is_available() and dist.is_initialized():
            base = self.process_group if self.process_group is not None else dist.group.WORLD
            self._thread_group = new_subgroup(base, dist.get_process_group_ranks(base))  # (base's timeout)

    def wants_thread_group(self, module: nn.Module) -> bool:
        """Whether :meth:`open_thread_group` creates a group: the hook thread may run (``hook_thread`` True,
        or "auto" with ``module`` on CUDA)."""
        cuda = any(p.is_cuda for p in module.parameters())
        return self.hook_thread is True or (self.hook_thread == "auto" and cuda)

    def _forget_messages(self) -> None:
        self._group_of = None
        self._layouts.clear()
        if self._graphs is not None:
            self._graphs.clear()  # (they read the old groups' buffers)

    # ------------------------------------------------------------------------------ helpers
    @property
    def numels(self) -> Dict[str, int]:
        """Parameter name -> number of values (read-only use)."""
        return self._numels

    def world(self) -> Tuple[int, int]:
        """(rank, size) in ``process_group``."""
        return self._world if self._world is not None else C.world(self.process_group)

    @property
    def one_node(self) -> bool:
        """A multi-node algorithm (``hierarchical``: the registry's ``multi_node``) with the whole group
        inside one node: nothing crosses a slow link, so nothing is compressed and the reduction is DDP's
        own fp32 allreduce."""
        if self.algorithm == AUTO or not get_algorithm(self.algorithm).multi_node or self.node_size is None:
            return False
        return self.world()[1] <= self.node_size

    def _refresh_native(self) -> None:
        """Whether the hook runs DDP's plain fp32 allreduce only: hierarchical inside one node, or
        codec="auto" with fp32 everywhere (while it measures, and when that is its plan)."""
        self._native = self.one_node or (self.auto is not None and
                                         all(c.spec == _FP32.spec for c in self.plan.values()))

    def uses_feedback(self, codec: Codec) -> bool:
        return self.options.uses_feedback(codec)

    def config(self) -> Dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "error_feedback": self.error_feedback,
            "start_iter": self.start_iter,
            "message_mb": self.message_mb,
            "node_size": self.node_size,
            "policy": self.policy_fingerprint,
            "plan": ({name: "auto" for name in sorted(self.plan)} if self.auto is not None
                     else {name: c.spec for name, c in sorted(self.plan.items())}),
            **({"auto": self.auto.config()} if self.auto is not None else {}),
        }

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.config(), sort_keys=True).encode()).hexdigest()[:16]

    def _advance(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def _layout(self, bucket: dist.GradBucket, flat: torch.Tensor) -> _Layout:
        key = (bucket.index(), flat.data_ptr(), flat.numel())
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = _Layout(self, bucket, flat)
        return lay

    def check(self) -> None:
        """Raise the first error of a lowbit collective of this state with its own type (a
        :class:`lowbit.comm.CollectiveError`), if one failed: DDP re-raises it from ``backward()`` as a
        ``RuntimeError`` whose message holds it, so ``except CollectiveError`` around ``backward()`` does not
        catch it there; call this in the ``except RuntimeError`` handler (or let the next step's hook raise
        it)."""
        error = getattr(self, "error", None)
        if error is not None:
            raise error

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Iteration counter, configuration, this rank's error-feedback residuals (per parameter), and the
        rank and world size they belong to: save one per rank."""
        rank, size = self.world()
        return {
            "iter": self.iter,
            "config": self.config(),
            "rank": rank,
            "world_size": size,
            "residuals": residuals_state(self.residuals),
            **({"auto": self.auto.state_dict()} if self.auto is not None else {}),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, after checking it: same configuration, same rank and world size
        (residuals are per rank), a non-negative integer ``iter``, and one finite float tensor of the
        right size per known parameter. Anything else is a ``ValueError`` naming the problem."""
        if not isinstance(state, dict) or not {"iter", "config", "residuals"} <= set(state):
            raise ValueError("lowbit checkpoint must be a dict with 'iter', 'config' and 'residuals' "
                             f"(from LowbitState.state_dict()), got {type(state).__name__}"
                             + (f" with keys {sorted(state)}" if isinstance(state, dict) else ""))
        if state.get("config") != self.config():
            raise ValueError(
                "lowbit checkpoint was saved with a different codec/policy/algorithm configuration: "
                f"saved {state.get('config')}, current {self.config()}"
            )
        it = state["iter"]
        if isinstance(it, bool) or not isinstance(it, int) or it < 0:
            raise ValueError(f"lowbit checkpoint: 'iter' must be a non-negative int, got {it!r}")
        if it >= 2**53:  # the rounding seed (seed * 1_000_003 + iter * 1_009) must stay a 64-bit integer
            raise ValueError(f"lowbit checkpoint: 'iter' {it} is not a plausible step count (must be < 2**53)")
        missing = [k for k in ("rank", "world_size") if k not in state]
        if missing:
            raise ValueError(f"lowbit checkpoint has no {' or '.join(repr(k) for k in missing)}: residuals belong to "
                             "one rank of one world size, and a checkpoint that does not say whose they are cannot "
                             "be checked (save LowbitState.state_dict() as it is)")
        rank, size = self.world()
        if (state["rank"], state["world_size"]) != (rank, size):
            raise ValueError(
                f"lowbit checkpoint was saved by rank {state['rank']} of {state['world_size']}, this is rank "
                f"{rank} of {size}: error-feedback residuals belong to one rank of one world size; save "
                "state_dict() on every rank and load each rank's own (or start a new lowbit state)")
        # every residual checked (lowbit.feedback's one check) before anything is applied, the auto
        # decision included: residuals are keyed by parameter, whatever the plan
        required: List[str] = []
        if it > self.start_iter and self.auto is None:  # compressed steps have run: every error-feedback
            trained = set(self.params.values())          # parameter has its residual
            required = sorted(n for n, c in self.plan.items() if self.uses_feedback(c) and n in trained)
        loaded = load_residuals(state["residuals"], "lowbit checkpoint",
                                {n: self._numels.get(n) for n in self.plan}, self._devices, required)
        if self.auto is not None:  # then the decision (checked whole before it changes anything): it sets the
            # plan the residuals belong to
            self.auto.load_state_dict(self, state.get("auto", {"config": self.auto.config(), "decision": None}))
        self.iter = it
        if self.auto is not None:
            self.auto.forwards = it
        self.residuals = loaded
        self._forget_messages()  # rebuilt on the next step, from these residuals
        self._world = None  # read again (with _native) on the next step

    def __getstate__(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["process_group"] = None
        d["_layouts"] = {}
        d["_group_of"] = None
        d["_world"] = None
        d["_native"] = False
        d["_thread_group"] = None
        d["error"] = None
        d["_graphs"] = None  # (CUDA graphs and their memory: captured again after a restore)
        d["_graph_ok"] = {}
        d["_inline_for"], d["_inline"] = None, False
        return d
