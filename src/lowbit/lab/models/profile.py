"""Per-layer profiles of the networks: parameters and forward multiply-accumulates (MACs) per sample of each
layer, in forward order, walked from the module itself built on the meta device (no memory, no arithmetic).
The speed model (:mod:`lowbit.lab.perfmodel.networks`) rescales them to the published totals.

    layer_profile("resnet50")   # (LayerProfile("conv1", 9536, 118013952.0), LayerProfile("conv2_1", 75008, ...), ...)

:func:`module_profile` walks any module; :data:`PROFILE_NAMES` says how each network's layers are named in
its profile (conv1, conv2_1, ..., fc): the names follow this package's modules (``stem``, ``stages``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import torch
from torch import nn

from lowbit.lab.models import build_model, model_info

__all__ = ["LayerProfile", "module_profile", "layer_profile", "PROFILE_NAMES"]


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer (or group of layers): trainable parameters and forward MACs per sample."""

    name: str
    params: int
    macs: float


# kind of a parameterised module: convolutions and dense layers compute; norms and embeddings are
# counted for their parameters with no MACs (their arithmetic is negligible next to the matmuls)
_ZERO_MAC_KINDS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.Embedding)
_SHAPE_KEEPING = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
#: names a module's profile entry: (qualified module name, kind "conv" | "fc" | "lstm" | "norm", index of
#: that kind from 1 in forward order) -> entry name; modules given one name are summed into one entry
_Namer = Callable[[str, str, int], str]


def _pass_on(x: torch.Tensor) -> torch.Tensor:
    return x


def _lstm_layers(lstm: nn.LSTM, steps: int) -> list[tuple[int, float]]:
    """(params, MACs) per layer of ``lstm`` over ``steps`` time steps, per sample and per direction summed:
    the four gates' input and recurrent matmuls, ``4 H (I + R)``, plus the projection ``P H`` when there is
    one (R = P with a projection, else H), times the steps; gate nonlinearities and biases not counted."""
    dirs = 2 if lstm.bidirectional else 1
    rec = lstm.proj_size or lstm.hidden_size
    out = []
    for k in range(lstm.num_layers):
        inp = lstm.input_size if k == 0 else rec * dirs
        macs = dirs * steps * (4 * lstm.hidden_size * (inp + rec) + lstm.proj_size * lstm.hidden_size)
        params = sum(p.numel() for n, p in lstm.named_parameters() if re.search(rf"_l{k}(_reverse)?$", n))
        out.append((params, float(macs)))
    return out


def module_profile(model: nn.Module, in_shape: tuple[int, ...], name_of: _Namer) -> tuple[LayerProfile, ...]:
    """The per-layer profile of ``model`` from one forward pass of one sample of ``in_shape`` on the model's
    device (build it on the meta device: no memory, no arithmetic). Every module holding parameters of its
    own gets a forward hook that records its parameters and forward MACs per sample, from its type and the
    shapes of the call:

    * convolution: output elements x (in_channels / groups) x kernel area;
    * dense layer: output elements x in_features (in x out x rows, rows = time steps of a sequence);
    * LSTM, one entry per layer: see :func:`_lstm_layers`;
    * batch/layer/group norm, embedding: parameters, no MACs. Bias additions are not counted anywhere.

    ``name_of`` names each module's entry (see ``_Namer``); entries come in the order their names first
    appear. Every module holding parameters must be called exactly once in the pass."""
    rows: dict[str, list] = {}
    counts: dict[str, int] = {}
    seen: set[int] = set()

    def add(qualname: str, kind: str, params: int, macs: float) -> None:
        counts[kind] = counts.get(kind, 0) + 1
        row = rows.setdefault(name_of(qualname, kind, counts[kind]), [0, 0.0])
        row[0] += params
        row[1] += macs

    def hook(module: nn.Module, args: tuple, out: object) -> None:
        if id(module) in seen:
            raise ValueError(f"module {names[id(module)]!r} is called twice: the profile counts each layer once")
        seen.add(id(module))
        qualname = names[id(module)]
        params = sum(p.numel() for p in module.parameters(recurse=False))
        if isinstance(module, nn.LSTM):
            steps = args[0].shape[1 if module.batch_first else 0]
            for k, (p, m) in enumerate(_lstm_layers(module, steps)):
                add(f"{qualname}.l{k}", "lstm", p, m)
        elif isinstance(module, nn.modules.conv._ConvNd):
            # out[0]: the one sample's output
            add(qualname, "conv", params, float(out[0].numel() * (module.in_channels // module.groups)
                                                * math.prod(module.kernel_size)))
        elif isinstance(module, nn.Linear):
            add(qualname, "fc", params, float(out[0].numel() * module.in_features))
        elif isinstance(module, _ZERO_MAC_KINDS):
            add(qualname, "norm", params, 0.0)
        else:
            raise TypeError(f"no MAC count for {type(module).__name__} ({qualname!r})")

    names = {id(m): q for q, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None}
    handles = [m.register_forward_hook(hook) for m in model.modules() if id(m) in names]
    # During the walk norms pass their input on (same shape; their arithmetic on meta tensors costs ~1-3 ms
    # a call, most of a ResNet's walk); their hooks still fire. Eval mode: dropout does nothing either.
    norms = [m for m in model.modules() if isinstance(m, _SHAPE_KEEPING)]
    training = model.training
    try:
        for m in norms:
            m.forward = _pass_on
        with torch.no_grad():
            model.eval()(torch.zeros((1, *in_shape), device=next(model.parameters()).device))
    finally:
        model.train(training)
        for m in norms:
            del m.forward
        for h in handles:
            h.remove()
    if missing := sorted(q for i, q in names.items() if i not in seen):
        raise ValueError(f"modules never called in the forward pass: {missing}")
    return tuple(LayerProfile(name, params, macs) for name, (params, macs) in rows.items())


def _numbered(fc_first: int) -> _Namer:
    """conv1, conv2, ... and fc<fc_first>, fc<fc_first+1>, ... in forward order."""
    return lambda q, kind, i: f"fc{fc_first + i - 1}" if kind == "fc" else f"conv{i}"


def _resnet(block: str, first_stage: int) -> _Namer:
    """lowbit.lab.models' ResNets: the stem is conv1, each residual block one entry (``block`` formatted with
    the stage, counted from ``first_stage``, and the block from 1), then fc."""
    def name_of(q: str, kind: str, i: int) -> str:
        head, *rest = q.split(".")
        if head == "stages":
            return block.format(first_stage + int(rest[0]), int(rest[1]) + 1)
        return "conv1" if head == "stem" else head
    return name_of


def _bn_inception(q: str, kind: str, i: int) -> str:
    """lowbit.lab.models' BN-Inception in 12 entries: the stem, the ten inception modules, the dense layer."""
    head, *rest = q.split(".")
    return "block1" if head == "stem" else f"block{int(rest[0]) + 2}" if head == "inception" else "block12"


def _lstm(q: str, kind: str, i: int) -> str:
    """lowbit.lab.models' LSTM in the uniform split's 4 entries: lstm1-3 the LSTMP layers, lstm4 the output layer."""
    return f"lstm{i}" if kind == "lstm" else "lstm4"


#: How each network's profile entries are named (the networks the speed model knows; the decoders' attention
#: is a functional call no hook sees, and small_cnn is not one of the seeds' networks).
PROFILE_NAMES: dict[str, _Namer] = {
    "alexnet": _numbered(6), "vgg19": _numbered(6), "resnet50": _resnet("conv{}_{}", 2),
    "resnet152": _resnet("conv{}_{}", 2), "resnet110": _resnet("stage{}_{}", 1), "mlp": _numbered(1),
    "bn_inception": _bn_inception, "lstm": _lstm,
}


@functools.cache
def layer_profile(name: str) -> tuple[LayerProfile, ...]:
    """The profile of the network ``name`` (one of :data:`PROFILE_NAMES`), built on the meta device and
    walked (cached)."""
    with torch.device("meta"):
        model = build_model(name)
    return module_profile(model, model_info(name).in_shape, PROFILE_NAMES[name])
