"""The seed study's networks as parameter counts and FLOPs, so the model runs without building them
(docs/perfmodel.md, section 6).

Each :class:`Network` carries the *published* totals (parameters; forward multiply-accumulates per sample; its
``notes`` say where they come from), which only rescale its per-layer *profile* in forward order: lowbit.lab.models'
network of the same name, walked on the meta device (:func:`lowbit.lab.models.profile.layer_profile`); BN-Inception
and the LSTM keep a uniform split (12 and 4 groups, an assumption), the MLP its profile's own totals. The names
are lowbit.lab.models' (and so the study's). 1 MAC = 2 FLOPs and forward + backward = 3 x forward, so fwd+bwd FLOPs
per sample = 6 x forward MACs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lowbit.lab.models.profile import LayerProfile, layer_profile

__all__ = ["Network", "NETWORKS", "get_network", "FWD_BWD_FLOPS_PER_MAC"]

#: FLOPs of forward + backward per forward multiply-accumulate: 2 FLOPs per MAC x (1 fwd + 2 bwd).
FWD_BWD_FLOPS_PER_MAC = 6.0


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


def _uniform(prefix: str, groups: int) -> tuple[LayerProfile, ...]:
    return tuple(LayerProfile(f"{prefix}{i + 1}", 1, 1.0) for i in range(groups))


_BUILDERS: dict[str, Callable[[], Network]] = {
    "alexnet": lambda: Network("alexnet", 62_000_000, 0.72, layer_profile("alexnet"), "ImageNet",
                               "params: seed Fig. 3 (CNTK AlexNet); MACs: Krizhevsky et al. 2012"),
    "vgg19": lambda: Network("vgg19", 143_000_000, 19.6, layer_profile("vgg19"), "ImageNet",
                             "params: seed Fig. 3; MACs: He et al. 2016"),
    "resnet50": lambda: Network("resnet50", 25_000_000, 3.8, layer_profile("resnet50"),
                                "ImageNet", "params: seed Fig. 3; MACs: He et al. 2016 Table 1"),
    "resnet152": lambda: Network("resnet152", 60_000_000, 11.3, layer_profile("resnet152"),
                                 "ImageNet", "params: seed Fig. 3; MACs: He et al. 2016 Table 1"),
    "resnet110": lambda: Network("resnet110", 1_700_000, 0.253, layer_profile("resnet110"), "CIFAR-10",
                                 "params: He et al. 2016 Table 6 (seed Fig. 3 prints 1M); "
                                 "MACs: Li et al. 2017 Table 1"),
    "bn_inception": lambda: Network("bn_inception", 11_000_000, 2.0, _uniform("block", 12), "ImageNet",
                                    "params: seed Fig. 3; MACs ~2.0 G, a model-zoo figure (approximate); profile: "
                                    "uniform over 12 groups (assumption)"),
    "lstm": lambda: Network("lstm", 13_000_000, 1.3, _uniform("lstm", 4), "AN4", "params: seed Fig. 3; MACs: "
                            "13M params x 100 frames per sample (assumed: the seed gives no sequence length); "
                            "uniform profile"),
    "mlp": lambda: Network("mlp", sum(p.params for p in layer_profile("mlp")),
                           sum(p.macs for p in layer_profile("mlp")) / 1e9, layer_profile("mlp"), "MNIST",
                           "784-1024-1024-10 (Dettmers 2016)"),
}

NETWORKS: tuple[str, ...] = tuple(_BUILDERS)


def get_network(name: str) -> Network:
    """The :class:`Network` called ``name`` (lowbit.lab.models' name, case-insensitive); ValueError listing
    the known ones."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _BUILDERS:
        raise ValueError(f"unknown network {name!r}; known networks: {', '.join(NETWORKS)}")
    return _BUILDERS[key]()
