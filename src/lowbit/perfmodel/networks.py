"""The seed study's networks as parameter counts and FLOPs, so the model runs without building them.

Each :class:`Network` carries the *published* totals (parameters; forward multiply-accumulates per
sample) and a per-layer *profile* in forward order. Where the architecture is simple to write down
(AlexNet, VGG19, the ResNets, the MNIST MLP, the small CNN) the profile is computed below from the
layer shapes, and the published totals only rescale it; for BN-Inception and the LSTM the profile is a
uniform split (assumption, stated in ``notes``).

FLOPs convention: 1 MAC = 2 FLOPs, and forward + backward = 3 x forward (the backward pass computes
gradients with respect to inputs and to weights, each about one forward), so::

    fwd+bwd FLOPs per sample = 6 * forward MACs per sample

Sources of the published totals:

* Parameters of AlexNet (62M), VGG19 (143M), ResNet-50 (25M), ResNet-152 (60M), BN-Inception (11M),
  LSTM (13M): Grubic et al. (EDBT 2018), Figure 3 (CNTK's implementations). ResNet-110: He et al. 2016
  ("Deep Residual Learning", Table 6: 1.7M; the seed's Figure 3 prints 1M).
* Forward MACs: AlexNet 0.72 G (the commonly quoted count for Krizhevsky et al. 2012; torchvision's
  single-tower variant computes to 0.71 G); VGG19 19.6 G, ResNet-50 3.8 G and ResNet-152 11.3 G (He
  et al. 2016, Table 1 and Sec. 3.3, "FLOPs" there are multiply-adds); ResNet-110 0.253 G (Li et al.
  2017, "Pruning Filters for Efficient ConvNets", Table 1: 2.53e8); BN-Inception ~2.0 G (widely quoted
  model-zoo figure, not from Ioffe & Szegedy 2015, which gives no count: approximate); LSTM: 13M
  parameters x 100 frames per sample (assumption: one MAC per weight per frame, 100-frame utterance
  segments; the seed does not give the sequence length).
* MNIST MLP 784-1024-1024-10 (Dettmers 2016, Sec. 4) and the small CNN (Caffe's ``cifar10_quick``:
  conv5x5-32, pool, conv5x5-32, pool, conv5x5-64, pool, fc64, fc10) are computed exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["LayerProfile", "Network", "NETWORKS", "get_network", "network_names", "FWD_BWD_FLOPS_PER_MAC"]

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
        out = []
        for lp in self.profile:
            params = round(lp.params * self.params / p_total) if p_total else 0
            flops = FWD_BWD_FLOPS_PER_MAC * self.fwd_gmacs * 1e9 * (lp.macs / m_total if m_total else 0.0)
            out.append((lp.name, params, flops))
        return out


# --------------------------------------------------------------------------------- shape arithmetic
def _conv(name: str, cin: int, cout: int, k: int, hw_out: int, bias: bool = True) -> LayerProfile:
    """A k x k convolution: ``cin*cout*k^2 (+cout)`` weights, ``cin*cout*k^2*hw_out^2`` MACs."""
    weights = cin * cout * k * k
    return LayerProfile(name, weights + (cout if bias else 0), float(weights * hw_out * hw_out))


def _fc(name: str, fin: int, fout: int) -> LayerProfile:
    return LayerProfile(name, fin * fout + fout, float(fin * fout))


def _bn(name: str, c: int) -> LayerProfile:
    return LayerProfile(name, 2 * c, 0.0)  # gamma, beta; the arithmetic is negligible


def _merge(name: str, parts: list[LayerProfile]) -> LayerProfile:
    return LayerProfile(name, sum(p.params for p in parts), sum(p.macs for p in parts))


def _out(hw: int, k: int, stride: int, pad: int) -> int:
    return (hw + 2 * pad - k) // stride + 1


def alexnet_profile() -> tuple[LayerProfile, ...]:
    """AlexNet as in Krizhevsky (2014, "one weird trick"; torchvision): 5 conv + 3 fc, 224x224 input."""
    h1 = _out(224, 11, 4, 2)                       # 55
    p1 = _out(h1, 3, 2, 0)                         # 27
    p2 = _out(p1, 3, 2, 0)                         # 13
    p3 = _out(p2, 3, 2, 0)                         # 6
    return (
        _conv("conv1", 3, 64, 11, h1), _conv("conv2", 64, 192, 5, p1), _conv("conv3", 192, 384, 3, p2),
        _conv("conv4", 384, 256, 3, p2), _conv("conv5", 256, 256, 3, p2),
        _fc("fc6", 256 * p3 * p3, 4096), _fc("fc7", 4096, 4096), _fc("fc8", 4096, 1000),
    )


def vgg19_profile() -> tuple[LayerProfile, ...]:
    """VGG19 (Simonyan & Zisserman 2015, config E): 16 conv3x3 + 3 fc, 224x224 input."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
           512, 512, 512, 512, "M"]
    layers, cin, hw, i = [], 3, 224, 0
    for c in cfg:
        if c == "M":
            hw //= 2
            continue
        i += 1
        layers.append(_conv(f"conv{i}", cin, int(c), 3, hw))
        cin = int(c)
    layers += [_fc("fc6", cin * hw * hw, 4096), _fc("fc7", 4096, 4096), _fc("fc8", 4096, 1000)]
    return tuple(layers)


def resnet_imagenet_profile(blocks: tuple[int, int, int, int]) -> tuple[LayerProfile, ...]:
    """Bottleneck ResNet (He et al. 2016) for 224x224 input; one profile entry per residual block."""
    layers = [_merge("conv1", [_conv("conv1", 3, 64, 7, 112, bias=False), _bn("bn1", 64)])]
    cin, hw = 64, 56
    for stage, (n, mid) in enumerate(zip(blocks, (64, 128, 256, 512)), start=2):
        for b in range(n):
            stride = 2 if (b == 0 and stage > 2) else 1
            hw_out = hw // stride
            parts = [
                _conv("a", cin, mid, 1, hw, bias=False), _bn("a", mid),
                _conv("b", mid, mid, 3, hw_out, bias=False), _bn("b", mid),
                _conv("c", mid, 4 * mid, 1, hw_out, bias=False), _bn("c", 4 * mid),
            ]
            if b == 0:
                parts += [_conv("down", cin, 4 * mid, 1, hw_out, bias=False), _bn("down", 4 * mid)]
            layers.append(_merge(f"conv{stage}_{b + 1}", parts))
            cin, hw = 4 * mid, hw_out
    layers.append(_fc("fc", cin, 1000))
    return tuple(layers)


def resnet_cifar_profile(depth: int = 110) -> tuple[LayerProfile, ...]:
    """CIFAR ResNet (He et al. 2016, Sec. 4.2): 6n+2 layers, 16/32/64 channels, identity shortcuts."""
    n = (depth - 2) // 6
    layers = [_merge("conv1", [_conv("conv1", 3, 16, 3, 32, bias=False), _bn("bn1", 16)])]
    cin, hw = 16, 32
    for stage, c in enumerate((16, 32, 64), start=1):
        for b in range(n):
            hw_out = hw // 2 if (b == 0 and stage > 1) else hw
            parts = [_conv("a", cin, c, 3, hw_out, bias=False), _bn("a", c),
                     _conv("b", c, c, 3, hw_out, bias=False), _bn("b", c)]
            layers.append(_merge(f"stage{stage}_{b + 1}", parts))
            cin, hw = c, hw_out
    layers.append(_fc("fc", cin, 10))
    return tuple(layers)


def mlp_profile(sizes: tuple[int, ...] = (784, 1024, 1024, 10)) -> tuple[LayerProfile, ...]:
    return tuple(_fc(f"fc{i + 1}", a, b) for i, (a, b) in enumerate(zip(sizes, sizes[1:])))


def small_cnn_profile() -> tuple[LayerProfile, ...]:
    """Caffe ``cifar10_quick``: conv5x5(3->32), pool, conv5x5(32->32), pool, conv5x5(32->64), pool,
    fc64, fc10 (32x32 input, padding 2)."""
    return (
        _conv("conv1", 3, 32, 5, 32), _conv("conv2", 32, 32, 5, 16), _conv("conv3", 32, 64, 5, 8),
        _fc("fc1", 64 * 4 * 4, 64), _fc("fc2", 64, 10),
    )


def _uniform(prefix: str, groups: int) -> tuple[LayerProfile, ...]:
    return tuple(LayerProfile(f"{prefix}{i + 1}", 1, 1.0) for i in range(groups))


def _exact(name: str, profile: tuple[LayerProfile, ...], dataset: str, notes: str) -> Network:
    return Network(name, sum(p.params for p in profile), sum(p.macs for p in profile) / 1e9, profile,
                   dataset, notes)


_BUILDERS: dict[str, Callable[[], Network]] = {
    "alexnet": lambda: Network("alexnet", 62_000_000, 0.72, alexnet_profile(), "ImageNet",
                               "params: seed Fig. 3 (CNTK AlexNet); profile: torchvision layer shapes"),
    "vgg19": lambda: Network("vgg19", 143_000_000, 19.6, vgg19_profile(), "ImageNet",
                             "params: seed Fig. 3; MACs: He et al. 2016"),
    "resnet50": lambda: Network("resnet50", 25_000_000, 3.8, resnet_imagenet_profile((3, 4, 6, 3)),
                                "ImageNet", "params: seed Fig. 3; MACs: He et al. 2016 Table 1"),
    "resnet152": lambda: Network("resnet152", 60_000_000, 11.3, resnet_imagenet_profile((3, 8, 36, 3)),
                                 "ImageNet", "params: seed Fig. 3; MACs: He et al. 2016 Table 1"),
    "resnet110": lambda: Network("resnet110", 1_700_000, 0.253, resnet_cifar_profile(110), "CIFAR-10",
                                 "params: He et al. 2016 (seed Fig. 3 prints 1M); MACs: Li et al. 2017"),
    "bn_inception": lambda: Network("bn_inception", 11_000_000, 2.0, _uniform("block", 12), "ImageNet",
                                    "MACs approximate; profile: uniform over 12 groups (assumption)"),
    "lstm": lambda: Network("lstm", 13_000_000, 1.3, _uniform("lstm", 4), "AN4",
                            "MACs: 13M params x 100 frames per sample (assumption); uniform profile"),
    "mlp": lambda: _exact("mlp", mlp_profile(), "MNIST", "784-1024-1024-10 (Dettmers 2016)"),
    "cifar10_quick": lambda: _exact("cifar10_quick", small_cnn_profile(), "CIFAR-10", "Caffe cifar10_quick"),
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


def network_names() -> list[str]:
    return list(NETWORKS)


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
