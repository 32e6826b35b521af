"""The networks of the seeds, in plain PyTorch, behind one registry.

    model = build_model("resnet50")                          # ImageNet shape, 1000 classes
    model = build_model("mlp", num_classes=10, in_shape=(1, 8, 8))
    info = model_info("vgg19")    # in_shape, num_classes, the seed's count, ours, where it comes from
    with torch.device("meta"):    # shapes and counts without memory (what the speed model needs)
        big = build_model("vgg19")

Networks of Grubic et al. (2018), Figure 3 — built as CNTK built them, since the seed ran CNTK's
example networks — plus Dettmers' (2016) MNIST MLP, a small CNN for CPU-sized data and a
GPT-2-small-shaped decoder (a transformer for throughput runs; not in the seed):

============ ================== ===== ====================================================
name         input, classes     seed  ours (parameters)
============ ================== ===== ====================================================
alexnet      3x227x227, 1000    62M   62,003,496 (CNTK's single-tower AlexNet with LRN)
vgg19        3x224x224, 1000    143M  143,667,240
resnet50     3x224x224, 1000    25M   25,557,032
resnet152    3x224x224, 1000    60M   60,192,808
resnet110    3x32x32, 10        1M    1,730,714 (He et al.: 1.7M; the seed rounds down)
bn_inception 3x224x224, 1000    11M   11,285,224
lstm         16x363 frames, 132 13M   13,637,764 (CNTK's LSTMP c1024 p512 x3: 13,634,692)
mlp          784, 10            —     1,863,690 (Dettmers' 784-1024-1024-10)
small_cnn    1x8x8, 10          —     25,866
gpt2_small   256 tokens, 50257  —     163,037,184 (GPT-2 small 124,439,808 + untied head)
gpt_350m     1024 tokens, 50257 —     406,286,336 (GPT-2 medium shape: 24 x 1024, 16 heads)
gpt_760m     1024 tokens, 50257 —     838,359,040 (GPT-2 large shape: 36 x 1280, 20 heads)
gpt_1_3b     1024 tokens, 50257 —     1,416,552,448 (GPT-3 XL shape: 24 x 2048, 16 heads)
============ ================== ===== ====================================================

The three larger decoders are for sharded (FSDP2) runs; with a byte vocabulary (``num_classes=256``)
they hold 303,884,288, 710,356,480 and 1,211,748,352 parameters.

The seed prints whole millions rounded down; ``ModelInfo.seed_params_m`` keeps its number as printed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from lowbit.lab.models.alexnet import AlexNet
from lowbit.lab.models.gpt import GPT, GPT2_CONTEXT
from lowbit.lab.models.inception import BNInception
from lowbit.lab.models.lstm import AN4_FEATURES, AN4_SENONES, LSTMP
from lowbit.lab.models.resnet import CifarResNet, ImageNetResNet
from lowbit.lab.models.small import MLP, SmallCNN
from lowbit.lab.models.vgg import VGG

__all__ = [
    "ModelInfo",
    "available_models",
    "build_model",
    "model_info",
    "num_parameters",
]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a registered network expects and how big it is.

    ``in_shape`` is one sample's shape (no batch axis); ``task`` is ``"classify"`` (one label per
    sample) or ``"sequence"`` (one label per time step: targets of shape ``in_shape[:1]``).
    ``seed_params_m`` is the parameter count in millions as the seed's table prints it (None where the
    seed gives none); ``params`` is the exact count of :func:`build_model` with the defaults.
    """

    name: str
    title: str
    in_shape: tuple[int, ...]
    num_classes: int
    task: str
    params: int
    seed_params_m: float | None
    source: str
    notes: str = ""


def _flat(in_shape: Sequence[int]) -> int:
    return int(math.prod(in_shape))


def _build_lstm(num_classes: int, in_shape: tuple[int, ...], **kw: Any) -> nn.Module:
    # (T, F) float frames, or (T,) tokens: then the vocabulary is the output classes.
    if len(in_shape) == 1:
        kw.setdefault("vocab_size", num_classes)
        return LSTMP(num_classes=num_classes, **kw)
    if len(in_shape) != 2:
        raise ValueError(f"lstm wants in_shape (T, features) or (T,) tokens; got {in_shape}")
    return LSTMP(num_classes=num_classes, input_dim=in_shape[1], **kw)


def _gpt_size(n_layers: int, n_heads: int, d_model: int) -> Callable[..., nn.Module]:
    def build(num_classes: int, in_shape: tuple[int, ...], **kw: Any) -> nn.Module:
        for key, value in (("n_layers", n_layers), ("n_heads", n_heads), ("d_model", d_model)):
            kw.setdefault(key, value)
        return _build_gpt(num_classes, in_shape, **kw)

    return build


def _build_gpt(num_classes: int, in_shape: tuple[int, ...], **kw: Any) -> nn.Module:
    # (T,) tokens; the vocabulary is the output classes. T may not exceed the context (default 1024).
    if len(in_shape) != 1:
        raise ValueError(f"gpt2_small wants in_shape (T,) tokens; got {in_shape}")
    context = int(kw.setdefault("context", GPT2_CONTEXT))
    if in_shape[0] > context:
        raise ValueError(f"gpt2_small: sequence length {in_shape[0]} exceeds the context {context}")
    return GPT(vocab_size=num_classes, **kw)


_FIG3 = "Grubic et al. 2018, Figure 3"

# name -> (builder(num_classes, in_shape, **kwargs), info)
_REGISTRY: dict[str, tuple[Callable[..., nn.Module], ModelInfo]] = {
    "alexnet": (
        lambda c, s, **kw: AlexNet(num_classes=c, in_channels=s[0], **kw),
        ModelInfo("alexnet", "AlexNet (CNTK, single tower)", (3, 227, 227), 1000, "classify",
                  62_003_496, 62, _FIG3,
                  "96-192-384-384-256 conv maps with LRN, as CNTK's AlexNet_ImageNet.cntk; "
                  "torchvision's variant has 61.1M"),
    ),
    "vgg19": (
        lambda c, s, **kw: VGG(num_classes=c, in_channels=s[0], **kw),
        ModelInfo("vgg19", "VGG-19", (3, 224, 224), 1000, "classify", 143_667_240, 143, _FIG3),
    ),
    "resnet50": (
        lambda c, s, **kw: ImageNetResNet((3, 4, 6, 3), num_classes=c, in_channels=s[0], **kw),
        ModelInfo("resnet50", "ResNet-50", (3, 224, 224), 1000, "classify", 25_557_032, 25, _FIG3),
    ),
    "resnet152": (
        lambda c, s, **kw: ImageNetResNet((3, 8, 36, 3), num_classes=c, in_channels=s[0], **kw),
        ModelInfo("resnet152", "ResNet-152", (3, 224, 224), 1000, "classify", 60_192_808, 60,
                  _FIG3),
    ),
    "resnet110": (
        lambda c, s, **kw: CifarResNet(18, num_classes=c, in_channels=s[0], **kw),
        ModelInfo("resnet110", "ResNet-110 (CIFAR)", (3, 32, 32), 10, "classify", 1_730_714, 1,
                  _FIG3,
                  "projection shortcuts as CNTK's ResNet110_CIFAR10.cntk; He et al. quote 1.7M, "
                  "the seed's table prints 1M (whole millions, rounded down)"),
    ),
    "bn_inception": (
        lambda c, s, **kw: BNInception(num_classes=c, in_channels=s[0], **kw),
        ModelInfo("bn_inception", "BN-Inception (Inception-v2)", (3, 224, 224), 1000, "classify",
                  11_285_224, 11, _FIG3, "as CNTK's BN-Inception.bs; no auxiliary classifiers"),
    ),
    "lstm": (
        _build_lstm,
        ModelInfo("lstm", "3-layer LSTMP (AN4 acoustic model)", (16, AN4_FEATURES), AN4_SENONES,
                  "sequence", 13_637_764, 13, _FIG3,
                  "CNTK's AN4 lstmp-3layer-opt.ndl: 363 features, 1024 cells, projection 512, "
                  "132 senones (CNTK count 13,634,692); in_shape (T,) = token language model"),
    ),
    "mlp": (
        lambda c, s, **kw: MLP(in_features=_flat(s), num_classes=c, **kw),
        ModelInfo("mlp", "Dettmers' MNIST MLP", (784,), 10, "classify", 1_863_690, None,
                  "Dettmers 2016, §MNIST (architecture; no count printed)",
                  "784-1024-1024-10, ReLU, dropout 0.2/0.3/0.3; in_shape sets the input width"),
    ),
    "small_cnn": (
        lambda c, s, **kw: SmallCNN(in_shape=s, num_classes=c, **kw),
        ModelInfo("small_cnn", "Small CNN (CPU-sized data)", (1, 8, 8), 10, "classify", 25_866,
                  None, "lowbit", "2-D for (C, H, W), 1-D for (C, L) or (L,)"),
    ),
    "gpt2_small": (
        _build_gpt,
        ModelInfo("gpt2_small", "GPT-2 small shape, untied head", (256,), 50257, "sequence",
                  163_037_184, None, "Radford et al. 2019 (GPT-2 small shape); lowbit",
                  "12 layers, 12 heads, d_model 768, context 1024, pre-LayerNorm, GELU MLP 4x, "
                  "learned positions; untied lm head (no bias): 124,439,808 + 38,597,376; "
                  "(N, T) int64 tokens -> (N, T, 50257) logits"),
    ),
    "gpt_350m": (
        _gpt_size(24, 16, 1024),
        ModelInfo("gpt_350m", "Decoder, GPT-2 medium shape, untied head", (1024,), 50257, "sequence",
                  406_286_336, None, "Radford et al. 2019 (GPT-2 medium shape); lowbit",
                  "24 layers, 16 heads, d_model 1024; as gpt2_small otherwise"),
    ),
    "gpt_760m": (
        _gpt_size(36, 20, 1280),
        ModelInfo("gpt_760m", "Decoder, GPT-2 large shape, untied head", (1024,), 50257, "sequence",
                  838_359_040, None, "Radford et al. 2019 (GPT-2 large shape); lowbit",
                  "36 layers, 20 heads, d_model 1280; as gpt2_small otherwise"),
    ),
    "gpt_1_3b": (
        _gpt_size(24, 16, 2048),
        ModelInfo("gpt_1_3b", "Decoder, GPT-3 XL shape, untied head", (1024,), 50257, "sequence",
                  1_416_552_448, None, "Brown et al. 2020 (GPT-3 XL shape); lowbit",
                  "24 layers, 16 heads, d_model 2048; as gpt2_small otherwise"),
    ),
}


def available_models() -> list[str]:
    """Names accepted by :func:`build_model`, sorted."""
    return sorted(_REGISTRY)


def _lookup(name: str) -> tuple[Callable[..., nn.Module], ModelInfo]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(available_models())}"
        ) from None


def model_info(name: str) -> ModelInfo:
    """Default input shape, classes, task and parameter counts (ours and the seed's) of ``name``."""
    return _lookup(name)[1]


def build_model(
    name: str,
    num_classes: int | None = None,
    in_shape: Sequence[int] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build network ``name`` (fresh weights) for ``num_classes`` outputs and samples of ``in_shape``.

    Both default to :func:`model_info`'s values. Extra keyword arguments go to the network's
    constructor (e.g. ``dropout=``). Builds on the current default device, so
    ``with torch.device("meta"): build_model("vgg19")`` costs no memory.
    """
    builder, info = _lookup(name)
    classes = info.num_classes if num_classes is None else int(num_classes)
    shape = info.in_shape if in_shape is None else tuple(int(s) for s in in_shape)
    if classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {classes}")
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"in_shape must be non-empty positive sizes, got {in_shape}")
    return builder(classes, shape, **kwargs)


def num_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of parameter values (what data-parallel training communicates each step)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
