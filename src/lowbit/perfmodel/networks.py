"""The seed study's networks as parameter counts and FLOPs, so the model runs without building them
(docs/perfmodel.md, section 6).

Each :class:`Network` carries the *published* totals (parameters; forward multiply-accumulates per sample),
which only rescale its per-layer *profile* in forward order. Profiles are walked from lowbit.models'
network of the same name, built on the meta device (:func:`module_profile`; cached); BN-Inception and
the LSTM keep a uniform split (12 and 4 groups; an assumption stated in ``notes``). The names are
lowbit.models' (and so the study's): one set of names across study, predict and advise.

FLOPs: 1 MAC = 2 FLOPs and forward + backward = 3 x forward, so fwd+bwd FLOPs per sample = 6 x forward MACs.
Where each published total comes from is the network's ``notes`` (and docs/perfmodel.md's table); the MLP
784-1024-1024-10 (Dettmers 2016) uses its profile's own totals.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import torch
from torch import nn

from lowbit.models import build_model, model_info

__all__ = ["LayerProfile", "Network", "NETWORKS", "get_network", "FWD_BWD_FLOPS_PER_MAC",
           "MODEL_SOURCES", "module_profile", "network_profile"]

#: FLOPs of forward + backward per forward multiply-accumulate: 2 FLOPs per MAC x (1 fwd + 2 bwd).
FWD_BWD_FLOPS_PER_MAC = 6.0


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer (or group of layers): trainable parameters and forward MACs per sample."""

    name: str
    params: int
    macs: float


@dataclasses.dataclass(frozen=True)
class Network:
    """A network as the speed model needs it (published totals + per-layer profile)."""

    name: str
    params: int                  # published parameter count
    fwd_gmacs: float             # published forward multiply-accumulates per sample, in 1e9
    profile: tuple[LayerProfile, ...]
    dataset: str = ""
    notes: str = ""

    @property
    def fwd_bwd_gflops(self) -> float:
        """Forward + backward GFLOPs per sample: ``6 * fwd_gmacs``."""
        return FWD_BWD_FLOPS_PER_MAC * self.fwd_gmacs

    def layers(self) -> list[tuple[str, int, float]]:
        """``(name, params, fwd+bwd FLOPs per sample)`` per layer, scaled to the published totals."""
        p_total = sum(lp.params for lp in self.profile)
        m_total = sum(lp.macs for lp in self.profile)
        return [(lp.name, round(lp.params * self.params / p_total) if p_total else 0,
                 self.fwd_bwd_gflops * 1e9 * (lp.macs / m_total if m_total else 0.0)) for lp in self.profile]


# ------------------------------------------------------------------------ profiles from torch modules
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
    """lowbit.models' ResNets: the stem is conv1, each residual block one entry (``block`` formatted with
    the stage, counted from ``first_stage``, and the block from 1), then fc."""
    def name_of(q: str, kind: str, i: int) -> str:
        head, *rest = q.split(".")
        if head == "stages":
            return block.format(first_stage + int(rest[0]), int(rest[1]) + 1)
        return "conv1" if head == "stem" else head
    return name_of


def _bn_inception(q: str, kind: str, i: int) -> str:
    """lowbit.models' BN-Inception in 12 entries: the stem, the ten inception modules, the dense layer."""
    head, *rest = q.split(".")
    return "block1" if head == "stem" else f"block{int(rest[0]) + 2}" if head == "inception" else "block12"


def _lstm(q: str, kind: str, i: int) -> str:
    """lowbit.models' LSTM in the uniform split's 4 entries: lstm1-3 the LSTMP layers, lstm4 the output layer."""
    return f"lstm{i}" if kind == "lstm" else "lstm4"


#: How each network's profile entries are named, by lowbit.models name (the module and its input shape
#: are lowbit.models'; BN-Inception's and the LSTM's walks are kept beside their uniform splits).
MODEL_SOURCES: dict[str, _Namer] = {
    "alexnet": _numbered(6), "vgg19": _numbered(6), "resnet50": _resnet("conv{}_{}", 2),
    "resnet152": _resnet("conv{}_{}", 2), "resnet110": _resnet("stage{}_{}", 1), "mlp": _numbered(1),
    "bn_inception": _bn_inception, "lstm": _lstm,
}


@functools.cache
def network_profile(name: str) -> tuple[LayerProfile, ...]:
    """The profile of lowbit.models' ``name``, built on the meta device and walked (cached)."""
    with torch.device("meta"):
        model = build_model(name)
    return module_profile(model, model_info(name).in_shape, MODEL_SOURCES[name])


def _uniform(prefix: str, groups: int) -> tuple[LayerProfile, ...]:
    return tuple(LayerProfile(f"{prefix}{i + 1}", 1, 1.0) for i in range(groups))


_BUILDERS: dict[str, Callable[[], Network]] = {
    "alexnet": lambda: Network("alexnet", 62_000_000, 0.72, network_profile("alexnet"), "ImageNet",
                               "params: seed Fig. 3 (CNTK AlexNet); MACs: Krizhevsky et al. 2012"),
    "vgg19": lambda: Network("vgg19", 143_000_000, 19.6, network_profile("vgg19"), "ImageNet",
                             "params: seed Fig. 3; MACs: He et al. 2016"),
    "resnet50": lambda: Network("resnet50", 25_000_000, 3.8, network_profile("resnet50"),
                                "ImageNet", "params: seed Fig. 3; MACs: He et al. 2016 Table 1"),
    "resnet152": lambda: Network("resnet152", 60_000_000, 11.3, network_profile("resnet152"),
                                 "ImageNet", "params: seed Fig. 3; MACs: He et al. 2016 Table 1"),
    "resnet110": lambda: Network("resnet110", 1_700_000, 0.253, network_profile("resnet110"), "CIFAR-10",
                                 "params: He et al. 2016 Table 6 (seed Fig. 3 prints 1M); "
                                 "MACs: Li et al. 2017 Table 1"),
    "bn_inception": lambda: Network("bn_inception", 11_000_000, 2.0, _uniform("block", 12), "ImageNet",
                                    "params: seed Fig. 3; MACs ~2.0 G, a model-zoo figure (approximate); profile: "
                                    "uniform over 12 groups (assumption)"),
    "lstm": lambda: Network("lstm", 13_000_000, 1.3, _uniform("lstm", 4), "AN4", "params: seed Fig. 3; MACs: "
                            "13M params x 100 frames per sample (assumed: the seed gives no sequence length); "
                            "uniform profile"),
    "mlp": lambda: Network("mlp", sum(p.params for p in network_profile("mlp")),
                           sum(p.macs for p in network_profile("mlp")) / 1e9, network_profile("mlp"), "MNIST",
                           "784-1024-1024-10 (Dettmers 2016)"),
}

NETWORKS: tuple[str, ...] = tuple(_BUILDERS)


def get_network(name: str) -> Network:
    """The :class:`Network` called ``name`` (lowbit.models' name, case-insensitive); ValueError listing
    the known ones."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _BUILDERS:
        raise ValueError(f"unknown network {name!r}; known networks: {', '.join(NETWORKS)}")
    return _BUILDERS[key]()
