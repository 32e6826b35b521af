"""The seed study's networks as parameter counts and FLOPs, so the model runs without building them
(docs/perfmodel.md, section 6).

Each :class:`Network` carries the *published* totals (parameters; forward multiply-accumulates per sample),
which only rescale its per-layer *profile* in forward order. Profiles are walked from torch modules built on
the meta device (:func:`module_profile`; cached): lowbit.models' network of the same name for VGG19,
ResNet-50/152 and the MNIST MLP; where the model has always used another variant, that variant is written
here so the predictions do not move: torchvision's AlexNet (61.1M parameters, 0.714 GMACs; lowbit.models
builds CNTK's), He et al.'s ResNet-110 with parameter-free shortcuts (lowbit.models': 1x1 projections), and
Caffe's cifar10_quick. BN-Inception and the LSTM keep a uniform split (12 and 4 groups; an assumption stated
in ``notes``): walking lowbit.models' modules (``MODEL_SOURCES`` has them) would move BN-Inception's advice
by up to ~15%.

FLOPs: 1 MAC = 2 FLOPs and forward + backward = 3 x forward, so fwd+bwd FLOPs per sample = 6 x forward MACs.
Published totals: parameters from Grubic et al. (EDBT 2018), Figure 3 (CNTK's implementations), except
ResNet-110 (He et al. 2016, Table 6: 1.7M; the seed prints 1M); forward MACs: AlexNet 0.72 G (the count
commonly quoted for Krizhevsky et al. 2012), VGG19 19.6 G, ResNet-50 3.8 G and ResNet-152 11.3 G (He et al.
2016, Table 1), ResNet-110 0.253 G (Li et al. 2017, Table 1), BN-Inception ~2.0 G (a model-zoo figure:
approximate), LSTM 13M parameters x 100 frames per sample (assumed: the seed gives no sequence length). The
MLP 784-1024-1024-10 (Dettmers 2016) and cifar10_quick use their profiles' own totals.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import OrderedDict
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

    @property
    def gradient_mb(self) -> float:
        """32-bit gradient size in MB (1e6 bytes): ``4 * params / 1e6``."""
        return 4 * self.params / 1e6

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


def _first_part(q: str, kind: str, i: int) -> str:
    """The modules below are named as the profile names their layers."""
    return q.split(".")[0]


def _torchvision_alexnet() -> nn.Module:
    """torchvision's single-tower AlexNet (64-192-384-256-256 maps, no LRN; 61,100,840 parameters)."""
    relu = nn.ReLU(inplace=True)  # in place: no meta kernel to run (and no parameters, so one can serve)
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(3, 64, 11, stride=4, padding=2), relu1=relu, pool1=nn.MaxPool2d(3, 2),
        conv2=nn.Conv2d(64, 192, 5, padding=2), relu2=relu, pool2=nn.MaxPool2d(3, 2),
        conv3=nn.Conv2d(192, 384, 3, padding=1), relu3=relu, conv4=nn.Conv2d(384, 256, 3, padding=1), relu4=relu,
        conv5=nn.Conv2d(256, 256, 3, padding=1), relu5=relu, pool5=nn.MaxPool2d(3, 2), flat=nn.Flatten(),
        fc6=nn.Linear(256 * 6 * 6, 4096), fc7=nn.Linear(4096, 4096), fc8=nn.Linear(4096, 1000),
    ))


def _resnet110_identity() -> nn.Module:
    """He et al.'s CIFAR ResNet-110 with parameter-free (zero-padding) shortcuts: 1,727,962 parameters. The
    shortcut adds no parameters and changes no shape, so the blocks' bodies in sequence give the profile."""
    def conv_bn(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    layers: dict[str, nn.Module] = {"conv1": nn.Sequential(*conv_bn(3, 16))}
    cin = 16
    for stage, c in enumerate((16, 32, 64), start=1):
        for b in range(18):
            layers[f"stage{stage}_{b + 1}"] = nn.Sequential(*conv_bn(cin, c, 2 if b == 0 and stage > 1 else 1),
                                                            *conv_bn(c, c))
            cin = c
    return nn.Sequential(OrderedDict(layers, pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten(), fc=nn.Linear(64, 10)))


def _cifar10_quick() -> nn.Module:
    """Caffe's ``cifar10_quick`` (145,578 parameters); Caffe's pooling rounds up: 32 -> 16 -> 8 -> 4."""
    relu = nn.ReLU(inplace=True)
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(3, 32, 5, padding=2), pool1=nn.MaxPool2d(3, 2, ceil_mode=True), relu1=relu,
        conv2=nn.Conv2d(32, 32, 5, padding=2), relu2=relu, pool2=nn.AvgPool2d(3, 2, ceil_mode=True),
        conv3=nn.Conv2d(32, 64, 5, padding=2), relu3=relu, pool3=nn.AvgPool2d(3, 2, ceil_mode=True),
        flat=nn.Flatten(), fc1=nn.Linear(64 * 4 * 4, 64), fc2=nn.Linear(64, 10),
    ))


#: Where each profile comes from: a lowbit.models name (its default input shape) or, for the variants
#: lowbit.models does not build, a module here and its input shape; and how its layers are named.
MODEL_SOURCES: dict[str, tuple[str | Callable[[], nn.Module], tuple[int, ...] | None, _Namer]] = {
    "alexnet": (_torchvision_alexnet, (3, 224, 224), _first_part),
    "vgg19": ("vgg19", None, _numbered(6)),
    "resnet50": ("resnet50", None, _resnet("conv{}_{}", 2)),
    "resnet152": ("resnet152", None, _resnet("conv{}_{}", 2)),
    "resnet110": (_resnet110_identity, (3, 32, 32), _first_part),
    "mlp": ("mlp", None, _numbered(1)),
    "cifar10_quick": (_cifar10_quick, (3, 32, 32), _first_part),
    # lowbit.models' own builds where the speed model keeps another profile (see the module docstring)
    "alexnet_cntk": ("alexnet", None, _numbered(6)),
    "resnet110_projection": ("resnet110", None, _resnet("stage{}_{}", 1)),
    "bn_inception": ("bn_inception", None, _bn_inception),
    "lstm": ("lstm", None, _lstm),
}


@functools.cache
def network_profile(name: str) -> tuple[LayerProfile, ...]:
    """The profile of ``MODEL_SOURCES[name]``'s module, built on the meta device and walked (cached)."""
    source, in_shape, name_of = MODEL_SOURCES[name]
    with torch.device("meta"):
        model = build_model(source) if isinstance(source, str) else source()
    return module_profile(model, in_shape or model_info(str(source)).in_shape, name_of)


def _uniform(prefix: str, groups: int) -> tuple[LayerProfile, ...]:
    return tuple(LayerProfile(f"{prefix}{i + 1}", 1, 1.0) for i in range(groups))


def _exact(name: str, profile: tuple[LayerProfile, ...], dataset: str, notes: str) -> Network:
    return Network(name, sum(p.params for p in profile), sum(p.macs for p in profile) / 1e9, profile,
                   dataset, notes)


_BUILDERS: dict[str, Callable[[], Network]] = {
    "alexnet": lambda: Network("alexnet", 62_000_000, 0.72, network_profile("alexnet"), "ImageNet",
                               "params: seed Fig. 3 (CNTK AlexNet); profile: torchvision layer shapes"),
    "vgg19": lambda: Network("vgg19", 143_000_000, 19.6, network_profile("vgg19"), "ImageNet",
                             "params: seed Fig. 3; MACs: He et al. 2016"),
    "resnet50": lambda: Network("resnet50", 25_000_000, 3.8, network_profile("resnet50"),
                                "ImageNet", "params: seed Fig. 3; MACs: He et al. 2016 Table 1"),
    "resnet152": lambda: Network("resnet152", 60_000_000, 11.3, network_profile("resnet152"),
                                 "ImageNet", "params: seed Fig. 3; MACs: He et al. 2016 Table 1"),
    "resnet110": lambda: Network("resnet110", 1_700_000, 0.253, network_profile("resnet110"), "CIFAR-10",
                                 "params: He et al. 2016 (seed Fig. 3 prints 1M); MACs: Li et al. 2017"),
    "bn_inception": lambda: Network("bn_inception", 11_000_000, 2.0, _uniform("block", 12), "ImageNet",
                                    "MACs approximate; profile: uniform over 12 groups (assumption)"),
    "lstm": lambda: Network("lstm", 13_000_000, 1.3, _uniform("lstm", 4), "AN4",
                            "MACs: 13M params x 100 frames per sample (assumption); uniform profile"),
    "mlp": lambda: _exact("mlp", network_profile("mlp"), "MNIST", "784-1024-1024-10 (Dettmers 2016)"),
    "cifar10_quick": lambda: _exact("cifar10_quick", network_profile("cifar10_quick"), "CIFAR-10",
                                    "Caffe cifar10_quick"),
}

# The names are lowbit.models' (and so the study's) wherever the network is the same one: one set of
# names across study, predict and advise. Older spellings still resolve.
_ALIASES = {
    "resnet-50": "resnet50", "resnet-152": "resnet152", "resnet-110": "resnet110", "vgg": "vgg19",
    "vgg-19": "vgg19", "bninception": "bn_inception", "bn-inception": "bn_inception",
    "inception": "bn_inception", "mnist-mlp": "mlp", "mnist_mlp": "mlp", "mnist": "mlp",
    "cifar10-quick": "cifar10_quick",
}

#: Names that used to mean a different network here than in lowbit.models: refused with the reason.
_RETIRED = {
    "small-cnn": "the speed model's 'small-cnn' was Caffe's cifar10_quick (145,578 parameters, CIFAR-10), "
                 "not lowbit.models' small_cnn (25,866 parameters, 8x8 inputs), which the speed model has no "
                 "profile of: use 'cifar10_quick'",
}
for _name in ("small_cnn", "smallcnn", "cnn"):
    _RETIRED[_name] = _RETIRED["small-cnn"]

NETWORKS: tuple[str, ...] = tuple(_BUILDERS)


def get_network(name: str) -> Network:
    """The :class:`Network` called ``name`` (case-insensitive); ValueError listing the known ones."""
    if not isinstance(name, str):
        raise ValueError(f"network name must be a string, got {name!r}")
    key = name.strip().lower()
    if key in _RETIRED:
        raise ValueError(f"network {name!r}: {_RETIRED[key]}")
    key = _ALIASES.get(key, key)
    if key not in _BUILDERS:
        raise ValueError(f"unknown network {name!r}; known networks: {', '.join(NETWORKS)}")
    return _BUILDERS[key]()
