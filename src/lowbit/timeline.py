"""The one plan of a step's messages: what lowbit.ddp's hook sends, and what a replay of the step prices.

DDP hands gradients over in buckets, in the order they become ready (backward order). The hook sends:

* every quantised tensor in a *message group*: consecutive tensors of one codec, closed when the codec
  changes, after every tensor of a per-tensor codec, and at the size limit (``message_mb`` MiB of fp32;
  ``"auto"``: :func:`message_limit`, reached where a DDP bucket ends, and the step's last bucket alone);
* every natively summed tensor (fp32, fp16, bf16) in one collective per codec per DDP bucket, except
  that when the quantised codecs go by ``allgather`` the fp32 tensors *ride* raw in a message: the open
  one, else the next; fp32 tensors after the last quantised one ride in the last message for a
  numeric ``message_mb`` and go natively with their buckets for ``"auto"``. Messages whose algorithm
  takes no riders (``scatter_gather``, ``hierarchical``: ``riderless``) carry none: an fp32 tensor
  that would ride in one, or waits for the next message when that one opens, goes natively instead.

:func:`plan_step` computes that plan from the tensors' sizes and codec specs and the codecs' facts
(which specs sum on the wire, which send per tensor, which one rides). It is pure arithmetic: the hook
(:func:`lowbit.ddp._plan_groups`), the replay ``codec="auto"`` decides with (:func:`lowbit.choose.simulate`)
and the speed model read the same :class:`StepPlan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Union

__all__ = ["DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "AUTO_MESSAGE_MIN", "AUTO_MESSAGE_SHARE", "Message",
           "StepPlan", "ddp_buckets", "message_limit", "closes_after", "plan_step"]

#: DDP's first bucket holds at least this much (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), the
#: others at least its ``bucket_cap_mb`` (default 25 MiB)
DDP_FIRST_BUCKET_BYTES = 2**20
DDP_BUCKET_BYTES = 25 * 2**20
#: ``message_mb="auto"``: a message holds at least this much fp32 ...
AUTO_MESSAGE_MIN = 16 * 2**20
#: ... and at least this share of the model's quantised gradients (at most about eight messages a step);
#: it closes only where a DDP bucket ends, and DDP's last bucket of the step goes alone (ddp module doc).
AUTO_MESSAGE_SHARE = 1 / 8


def message_limit(message_mb: Union[float, str], quantised_bytes: float) -> float:
    """Bytes of fp32 after which a message group closes: ``message_mb`` MiB, or for ``"auto"`` the larger
    of 16 MiB and an eighth of ``quantised_bytes`` (the model's quantised gradients, fp32), reached at
    the end of a DDP bucket."""
    if message_mb == "auto":
        return max(AUTO_MESSAGE_MIN, quantised_bytes * AUTO_MESSAGE_SHARE)
    return float(message_mb) * 2**20


def ddp_buckets(numels: Sequence[int], bucket_bytes: float = DDP_BUCKET_BYTES, itemsize: int = 4,
                first_bytes: float = DDP_FIRST_BUCKET_BYTES) -> list[int]:
    """How DDP cuts tensors (sizes in the order their gradients become ready) into buckets, as
    ``torch.distributed._compute_bucket_assignment_by_size`` does for one dtype and device: a bucket
    closes once it holds at least its limit (the first ``first_bytes``: 1 MiB with DDP's default cap,
    else the cap itself; the others ``bucket_bytes``). Returns each tensor's bucket index."""
    out, index, size, limit = [], 0, 0, first_bytes
    for n in numels:
        out.append(index)
        size += itemsize * n
        if size >= limit:
            index, size, limit = index + 1, 0, bucket_bytes
    return out


def closes_after(i: int, buckets: Sequence[int], size_bytes: float, limit: float) -> bool:
    """``message_mb="auto"``: whether a message group ends after tensor ``i`` (of ``buckets``, each tensor's
    DDP bucket): where a bucket ends, once it holds ``limit`` bytes of fp32 or when the next bucket is
    the step's last (that one goes alone: what is sent after the backward pass is only the last
    bucket, whose data cannot arrive earlier)."""
    if i + 1 >= len(buckets) or buckets[i + 1] == buckets[i]:
        return False
    return size_bytes >= limit or buckets[i + 1] == buckets[-1]


@dataclasses.dataclass(frozen=True)
class Message:
    """One message group: its codec spec, the tensors it sends quantised and the fp32 tensors riding raw
    in it (indices into the step's tensors, in ready order)."""

    spec: str
    members: tuple[int, ...]
    riders: tuple[int, ...] = ()

    @property
    def last(self) -> int:
        """The tensor whose gradient completes the message: it can be sent once that one is ready."""
        return max(self.members + self.riders)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step's messages: each tensor's DDP bucket, the message groups in the order they are sent, and
    the tensors reduced natively with their bucket (one collective per codec spec and bucket)."""

    buckets: tuple[int, ...]
    messages: tuple[Message, ...]
    native: tuple[int, ...]


def plan_step(numels: Sequence[int], specs: Sequence[str], *, native: Collection[str],
              per_tensor: Collection[str] = (), rider: str | None = None, message_mb: Union[float, str] = "auto",
              bucket_bytes: float = DDP_BUCKET_BYTES, first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
              buckets: Sequence[int] | None = None, riderless: Collection[str] = ()) -> StepPlan:
    """The messages of a step (module doc) for tensors of ``numels`` values in ready order, each sent with
    the codec of ``specs``: ``native`` names the specs summed on the wire, ``per_tensor`` those that send
    each tensor alone, ``rider`` the spec that rides in allgather messages (None: nothing rides),
    ``riderless`` the quantised specs whose messages take no riders (their algorithm is not allgather).
    ``buckets``: each tensor's DDP bucket when known (measured), else DDP's cut by the bucket caps."""
    if len(numels) != len(specs):
        raise ValueError(f"{len(numels)} tensor sizes for {len(specs)} codec specs")
    if buckets is None:
        buckets = ddp_buckets(numels, bucket_bytes, first_bytes=first_bucket_bytes)
    limit = message_limit(message_mb, sum(4 * n for n, s in zip(numels, specs) if s not in native))
    aligned = message_mb == "auto"  # close where DDP's buckets end
    groups: list[tuple[str, list[int], list[int]]] = []
    cur: tuple[str, list[int], list[int]] | None = None
    riders: list[int] = []
    size = 0
    for i, (n, spec) in enumerate(zip(numels, specs)):
        if spec in native:
            if spec == rider and (cur is None or cur[0] not in riderless):
                (cur[2] if cur is not None else riders).append(i)
        else:
            if cur is None or cur[0] != spec:
                cur = (spec, [], [] if spec in riderless else riders)
                riders = []  # (waiting riders that this message does not take go natively)
                groups.append(cur)
                size = 0
            cur[1].append(i)
            size += 4 * n
            if spec in per_tensor or (not aligned and size >= limit):
                cur = None
        if aligned and cur is not None and closes_after(i, buckets, size, limit):
            cur = None
    if riders and groups and not aligned and groups[-1][0] not in riderless:
        groups[-1][2].extend(riders)  # fp32 tensors after the last quantised one ride in the last message
    # (message_mb="auto": they are reduced natively with their own buckets instead; the last message may
    # have closed at an earlier bucket end, and would otherwise wait for DDP's last bucket)
    messages = tuple(Message(spec, tuple(members), tuple(rides)) for spec, members, rides in groups)
    sent = {i for m in messages for i in m.members + m.riders}
    return StepPlan(tuple(buckets), messages, tuple(i for i in range(len(specs)) if i not in sent))
