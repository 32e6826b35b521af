"""The per-layer profiles the speed model rescales, walked from torch modules on the meta device
(lowbit.lab.models.profile).

* every profile's parameters, per layer, are the module's own parameter counts, and its total is the
  exact count lowbit.lab.models records for that network (model_info);
* building a profile allocates no real parameter, buffer or activation (everything on meta);
* the MACs follow the counting rules (spot checks computed by hand below, not by the walk);
* profiles are cached, so each network is walked once per process.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from lowbit.lab.models import available_models, build_model, model_info
from lowbit.lab.models import profile as profile_mod
from lowbit.lab.models.profile import PROFILE_NAMES, LayerProfile, layer_profile, module_profile

def _expected_per_layer(name: str) -> dict[str, int]:
    """Parameter counts per profile entry straight from the module's named parameters (meta shapes)."""
    name_of = PROFILE_NAMES[name]
    with torch.device("meta"):
        model = build_model(name)
    owner = {id(p): q for q, m in model.named_modules() for p in m.parameters(recurse=False)}
    out: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for q, m in model.named_modules():
        own = list(m.parameters(recurse=False))
        if not own:
            continue
        if isinstance(m, torch.nn.LSTM):
            for k in range(m.num_layers):
                n = name_of(f"{q}.l{k}", "lstm", k + 1)
                out[n] = out.get(n, 0) + sum(p.numel() for pn, p in m.named_parameters()
                                             if pn.endswith((f"_l{k}", f"_l{k}_reverse")))
            continue
        kind = ("conv" if isinstance(m, torch.nn.modules.conv._ConvNd) else
                "fc" if isinstance(m, torch.nn.Linear) else "norm")
        kinds[kind] = kinds.get(kind, 0) + 1
        n = name_of(q, kind, kinds[kind])
        out[n] = out.get(n, 0) + sum(p.numel() for p in own)
    assert len(owner) == len({id(p) for p in model.parameters()})
    return out


@pytest.mark.parametrize("name", sorted(PROFILE_NAMES))
def test_profile_params_are_the_modules_own(name: str) -> None:
    profile = layer_profile(name)
    got = {lp.name: lp.params for lp in profile}
    assert len(got) == len(profile), "profile names repeat"
    assert got == _expected_per_layer(name)
    total = sum(lp.params for lp in profile)
    assert total == model_info(name).params
    assert all(lp.macs >= 0 for lp in profile)


def test_every_seed_network_of_lowbit_models_has_a_profile() -> None:
    # the decoders are not networks of the speed model (their attention is a functional call no hook sees)
    assert set(available_models()) - set(PROFILE_NAMES) == {"small_cnn", "gpt2_small", "gpt_350m", "gpt_760m", "gpt_1_3b"}


def test_small_modules_real_build_matches_meta_walk() -> None:
    """On real CPU modules (small ones) the walk's per-layer parameters are those of the meta walk."""
    for name in ("mlp", "resnet110"):
        model = build_model(name)
        assert all(p.device.type == "cpu" for p in model.parameters())
        real = {lp.name: lp.params for lp in module_profile(model, model_info(name).in_shape, PROFILE_NAMES[name])}
        assert real == {lp.name: lp.params for lp in layer_profile(name)}
        assert sum(real.values()) == sum(p.numel() for p in model.parameters())


#: One network of each layer kind (convolutional ones of lowbit.lab.models, the LSTM, an MLP): the default
#: run's networks for test_profiles_are_built_on_meta.
_META_FAST = ("resnet110", "mlp", "resnet50", "lstm")


@pytest.mark.parametrize("names", [pytest.param(_META_FAST, id="one-of-each-kind"),
                                   pytest.param(tuple(PROFILE_NAMES), marks=pytest.mark.slow, id="all")])
def test_profiles_are_built_on_meta(names: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """[all] (every network) is marked slow; its fast equivalent [one-of-each-kind] walks _META_FAST."""
    devices: list[set[str]] = []
    walk = profile_mod.module_profile

    def spy(model: torch.nn.Module, *args: object) -> tuple[LayerProfile, ...]:
        devices.append({t.device.type for t in [*model.parameters(), *model.buffers()]})
        return walk(model, *args)

    monkeypatch.setattr(profile_mod, "module_profile", spy)
    for name in names:
        profile_mod.layer_profile.__wrapped__(name)  # bypass the cache
    assert devices == [{"meta"}] * len(names)


def test_mac_counting_rules() -> None:
    """Counts by hand: conv out_elems x cin/groups x k^2, linear in x out x rows, LSTM gates x steps."""
    vgg = layer_profile("vgg19")
    assert vgg[0] == LayerProfile("conv1", 3 * 64 * 9 + 64, 64 * 224 * 224 * 3 * 9)
    assert vgg[-3] == LayerProfile("fc6", 512 * 7 * 7 * 4096 + 4096, 512 * 7 * 7 * 4096)
    # ResNet-50's first block: 1x1, 3x3, 1x1 (x4) and the projection, at 56x56, no biases, BN: 2 per channel
    r50 = {lp.name: lp for lp in layer_profile("resnet50")}
    assert r50["conv2_1"].macs == 56 * 56 * (64 * 64 + 64 * 64 * 9 + 64 * 256 + 64 * 256)
    assert r50["conv2_1"].params == 64 * 64 + 64 * 64 * 9 + 2 * 64 * 256 + 2 * (64 + 64 + 256 + 256)
    # LSTMP, 16 frames: layer 1 gates 4*1024*(363+512), projection 512*1024; output 512 -> 132 per frame
    lstm = layer_profile("lstm")
    steps = model_info("lstm").in_shape[0]
    assert lstm[0].macs == steps * (4 * 1024 * (363 + 512) + 512 * 1024)
    assert lstm[1].macs == steps * (4 * 1024 * (512 + 512) + 512 * 1024)
    assert lstm[3] == LayerProfile("lstm4", 512 * 132 + 132, steps * 512 * 132)
    # a grouped convolution counts in_channels / groups per output element
    conv = torch.nn.Conv2d(8, 16, 3, padding=1, groups=4, device="meta")
    (lp,) = module_profile(conv, (8, 5, 5), lambda q, kind, i: "c")
    assert lp == LayerProfile("c", 16 * 2 * 9 + 16, 16 * 25 * 2 * 9)


def test_walk_refuses_what_it_cannot_count() -> None:
    with torch.device("meta"):
        prelu = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.PReLU())
        unused = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    with pytest.raises(TypeError, match="PReLU"):
        module_profile(prelu, (4,), lambda q, kind, i: q)
    unused.forward = lambda x: unused["a"](x)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="never called"):
        module_profile(unused, (4,), lambda q, kind, i: q)
    assert not prelu[0]._forward_hooks and not unused["a"]._forward_hooks  # hooks removed either way


def test_profiles_are_cached_and_quick() -> None:
    assert layer_profile("resnet152") is layer_profile("resnet152")
    layer_profile("mlp")  # torch's first meta operations pay a one-off import
    for name in ("resnet152", "bn_inception"):
        start = time.perf_counter()
        layer_profile.__wrapped__(name)
        assert time.perf_counter() - start < 2.0, name  # ~0.3 s measured; generous for loaded machines
    assert math.isfinite(sum(lp.macs for lp in layer_profile("resnet152")))
