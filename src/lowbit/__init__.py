"""lowbit: low-precision (1-16 bit) gradient and activation communication for distributed PyTorch.

    codec = lowbit.get_codec("qsgd:bits=4,bucket=512")
    payload = codec.encode(grad, seed=step)            # really bit-packed uint8
    lowbit.all_reduce(grad, codec)                      # compressed collective over torch.distributed
    state = lowbit.ddp.register(ddp_model, codec="qsgd:bits=8")   # one line in a DDP script
"""

from __future__ import annotations

from lowbit._version import __version__
from lowbit.codecs import Codec, available_codecs, get_codec, parse_spec
from lowbit.feedback import ErrorFeedback

__all__ = ["Codec", "ErrorFeedback", "available_codecs", "get_codec", "parse_spec", "__version__"]


def __getattr__(name: str):  # lazy: collectives and DDP pull in torch.distributed
    if name == "all_reduce":
        from lowbit.comm.allreduce import all_reduce

        return all_reduce
    if name in ("ddp", "fsdp", "localsgd"):
        import importlib

        return importlib.import_module(f"lowbit.{name}")
    if name == "Policy":
        from lowbit.policy import Policy

        return Policy
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")
