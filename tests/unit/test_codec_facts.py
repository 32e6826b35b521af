"""Facts about a codec live on its class (issue 31 item 5): labels, whether a native allreduce sums it, whether
the seeds trained it with error feedback, its place on the bits ladder. The layers above ask the codec, so a
codec in one file (``tests/plugins/toy_codec.py``, or one defined here) gets all of them with no other file
touched, and ``codecs/base.py`` knows none of its subclasses (the import circle it had)."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import lowbit.codecs
from lowbit.codecs import base as codec_base
from lowbit.codecs.base import Codec, get_codec, register_codec
from lowbit.lab.perfmodel import advise as adv
from lowbit.lab.perfmodel.model import codec_fact, short_codec
from lowbit.lab.study import config as study_config
from lowbit.lab.study import runs as study_runs

SRC = Path(__file__).resolve().parents[2] / "src" / "lowbit"
BASE = SRC / "codecs" / "base.py"


@pytest.fixture
def registry_restored():
    """Codecs registered by a test leave the registry as they found it."""
    saved = (dict(codec_base._REGISTRY), set(codec_base._PLUGINS_LOADED))
    yield
    codec_base._REGISTRY.clear()
    codec_base._REGISTRY.update(saved[0])
    codec_base._PLUGINS_LOADED.clear()
    codec_base._PLUGINS_LOADED.update(saved[1])
    for name in [m for m in sys.modules if m.startswith("tests.plugins.")]:
        del sys.modules[name]


# ------------------------------------------------------------------------------ no import circle
def _codec_modules() -> list[str]:
    return sorted(p.stem for p in (SRC / "codecs").glob("*.py")
                  if p.stem not in lowbit.codecs.NOT_CODECS and not p.stem.startswith("_"))


def _sibling_imports(path: Path) -> list[str]:
    """The codec modules ``path`` imports, anywhere in it (functions too), statically or by name."""
    siblings = set(_codec_modules())
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # from . import qsgd / from .qsgd import QSGD
                names = [f"lowbit.codecs.{mod}" if mod else f"lowbit.codecs.{a.name}" for a in node.names]
            else:
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]  # importlib.import_module("lowbit.codecs.qsgd")
        found += [n for n in names if n.startswith("lowbit.codecs.") and n.split(".")[2] in siblings]
    return found


def test_codecs_base_imports_none_of_its_subclasses() -> None:
    assert _codec_modules() == ["dettmers", "floats", "onebit", "qsgd", "topk"]  # the scan sees them
    assert _sibling_imports(BASE) == [], _sibling_imports(BASE)


def test_codecs_base_stands_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Executed on its own (not as part of the package), base.py resolves codecs without importing anything
    of lowbit's: its registry is simply empty."""
    monkeypatch.setenv("LOWBIT_PLUGINS", "")
    asked: list[str] = []
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def spy_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 (its signature)
        asked.extend([name] + [f"{name}.{f}" for f in fromlist or ()])
        return real_import(name, globals, locals, fromlist, level)

    def spy_import_module(name, package=None):
        asked.append(name)
        return real_import_module(name, package)

    monkeypatch.setattr(builtins, "__import__", spy_import)
    monkeypatch.setattr(importlib, "import_module", spy_import_module)
    spec = importlib.util.spec_from_file_location("lone_codec_base", BASE)
    assert spec is not None and spec.loader is not None
    lone = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lone_codec_base", lone)  # (dataclasses look their module up)
    spec.loader.exec_module(lone)
    assert lone.available_codecs() == {}
    with pytest.raises(ValueError, match="unknown codec"):
        lone.get_codec("qsgd")
    assert not [n for n in asked if n.startswith("lowbit")], asked


def test_every_codec_module_of_the_package_is_registered_on_import() -> None:
    """A new built-in codec is its file: the package imports every codec module it holds."""
    for name in _codec_modules():
        mod = sys.modules.get(f"lowbit.codecs.{name}")
        assert mod is not None, name
        classes = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, Codec) and c.name]
        assert classes and all(codec_base._REGISTRY.get(c.name) is c for c in classes), name


def test_no_layer_compares_against_a_codec_name() -> None:
    """Outside codecs/, no ``x == "qsgd"`` or ``name != "dettmers"``: the layers ask the codec. (``fp32``, the
    uncompressed baseline, is still named where recorded rows are told apart.)"""
    names = set(codec_base.available_codecs()) - {"fp32"}
    found = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "codecs":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                consts = [n.value for n in [node.left, *node.comparators]
                          if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                found += [f"{path.relative_to(SRC)}:{node.lineno} {c!r}" for c in consts if c in names]
    assert not found, found


# ------------------------------------------------------------------------------ the built-ins' facts
@pytest.mark.parametrize("spec, short, rung", [
    ("fp32", "fp32", 6), ("fp16", "fp16", 5), ("bf16", "bf16", 5),
    ("qsgd:bits=16,bucket=8192", "qsgd16/8192", 5), ("qsgd:bits=8,bucket=512", "qsgd8/512", 4),
    ("qsgd:bits=4,bucket=512", "qsgd4/512", 3), ("qsgd:bits=2,bucket=128", "qsgd2/128", 2),
    ("qsgd:bits=1,bucket=32", "qsgd1/32", 1),  # 2 bits a value with its scales, a 1-bit code all the same
    ("onebit:bucket=64", "onebit/64", 1), ("onebit:bucket=0", "onebit/0", 1), ("onebit", "onebit/64", 1),
    ("dettmers:type=dynamic", "dettmers-dyn", 4), ("dettmers:type=linear,search=paper", "dettmers-lin", 4),
    ("dettmers:type=static,offset=1", "dettmers-sta", 4), ("dettmers:type=dynamic_bnb", "dettmers-bnb", 4),
    ("topk:ratio=0.01", "topk0.01", 0), ("topk", "topk0.01", 0),
])
def test_short_labels_and_ladder(spec: str, short: str, rung: int) -> None:
    codec = get_codec(spec)
    assert codec.short_label == short_codec(spec) == short
    assert codec.rung == rung == codec_fact(spec, "rung", 0)


def test_short_codec_of_a_spec_that_names_no_codec() -> None:
    assert short_codec("auto") == "auto" and short_codec("nonesuch:x=1") == "nonesuch"


def test_the_ladder_is_what_advice_orders_by() -> None:
    rungs = [c.rung for c in (adv.FP32,) + adv.CANDIDATES]
    assert rungs == [6, 5, 4, 4, 3, 2, 1]
    assert [c.name for c in adv.CANDIDATES if c.error_feedback] == ["dettmers", "onebit"]  # biased, quantised
    assert [c.label for c in adv.CANDIDATES] == ["fp16", "qsgd8/512", "dettmers-dyn +EF", "qsgd4/512",
                                                 "qsgd2/128", "onebit/64 +EF"]


@pytest.mark.parametrize("spec, auto, biased", [
    ("fp32", False, False), ("bf16", False, False), ("qsgd:bits=4", False, False),
    ("onebit:bucket=64", True, True), ("topk", True, True),
    ("dettmers", False, True),  # Dettmers (2016) used no error feedback; the study's "biased" turns it on
])
def test_study_error_feedback_follows_the_codec(spec: str, auto: bool, biased: bool) -> None:
    codec = get_codec(spec)
    assert study_runs._feedback("auto", codec) is auto
    assert study_runs._feedback("biased", codec) is biased


# ------------------------------------------------------------------------------ a codec in one file
def test_the_toy_plugin_gets_every_fact_from_the_defaults(registry_restored) -> None:
    """tests/plugins/toy_codec.py says nothing but its name, that it is biased, and its wire format."""
    import tests.plugins.toy_codec  # noqa: F401 (registers toy8)

    toy = get_codec("toy8")
    assert (toy.label, toy.short_label) == ("toy8", "toy8")
    assert not toy.sums_on_wire and toy.biased and toy.seeds_feedback
    assert abs(toy.code_bits - 8.0) < 1e-3 and toy.rung == 4  # 8 bits a value (and one scale): qsgd8's rung
    assert study_runs.codec_label("toy8", True) == "toy8 +EF"
    assert short_codec("toy8") == "toy8" and codec_fact("toy8", "rung", 0) == 4
    cand = adv.Candidate("toy8", "toy8")
    assert (cand.rung, cand.error_feedback, cand.label, cand.canonical) == (4, True, "toy8 +EF", "toy8")
    assert study_runs._feedback("auto", toy) and not study_runs._feedback("auto", get_codec("qsgd"))


@dataclasses.dataclass(frozen=True)
class _Sign2(Codec):
    """2-bit codes behind a float32 scale a tensor; says its own labels, ladder and the seeds' practice."""

    name: ClassVar[str] = "test_sign2"
    biased: ClassVar[bool] = True

    bucket: int = 128

    @property
    def label(self) -> str:
        return f"Sign 2bit/{self.bucket}"

    @property
    def short_label(self) -> str:
        return f"sign2/{self.bucket}"

    @property
    def code_bits(self) -> float:
        return 2.0

    @property
    def seeds_feedback(self) -> bool:
        return False

    def nbytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 4 * -(-numel // self.bucket) + (2 * numel + 7) // 8

    def encode(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        raise NotImplementedError  # (the facts need no transform)


def test_a_codec_defined_in_one_file_is_asked_for_its_facts(registry_restored) -> None:
    register_codec(_Sign2)
    spec = "test_sign2:bucket=64"
    codec = get_codec(spec)
    assert codec.rung == codec_fact(spec, "rung", 0) == 2 and codec.bits_per_value(1 << 16) == 2.5
    assert short_codec(spec) == "sign2/64" and study_runs.codec_label(spec) == "Sign 2bit/64"
    assert study_runs._feedback("auto", codec) is False and study_runs._feedback("biased", codec) is True
    cand = adv.Candidate("sign2", spec)
    assert (cand.rung, cand.error_feedback, cand.label) == (2, True, "sign2/64 +EF")
    # a policy of it and qsgd4: qsgd4 is higher on the ladder, so the policy's default
    policy = dataclasses.replace(_advice_stub(), assignment={"Conv2d": get_codec("qsgd:bits=4").spec,
                                                             "Linear": codec.spec}).policy_dict()
    assert policy["default"] == get_codec("qsgd:bits=4").spec and policy["by_type"]["Linear"] == codec.spec


def _advice_stub() -> adv.Advice:
    return adv.Advice(network="x", groups={}, assignment={}, fp32_is_best=False, prediction=None, options=[],
                      verdicts={}, cells={}, evidence_source="", direct_evidence=False, tolerance=0.5,
                      setup=None, notes=[])  # type: ignore[arg-type]


def test_advice_judges_a_candidate_of_a_codec_in_one_file(registry_restored) -> None:
    """A candidate is a name, a spec and what was published about it; no table elsewhere to extend."""
    register_codec(_Sign2)
    cand = adv.Candidate("sign2", "test_sign2", {"Conv2d": None, "Linear": 0.3, "LSTM": 0.0}, "a finding")
    assert adv.judge(cand, "Linear", "vgg19", {}, 0.5, {}).admissible
    assert not adv.judge(cand, "Linear", "vgg19", {}, 0.2, {}).admissible  # bound 0.3 > tolerance
    assert not adv.judge(cand, "Conv2d", "vgg19", {}, 0.5, {}).admissible
    bare = adv.judge(adv.Candidate("bare", "test_sign2"), "Linear", "vgg19", {}, 0.5, {})
    assert not bare.admissible and "no published finding" in bare.detail
    assert adv.SEED_FINDINGS["qsgd4"] == (adv.CANDIDATES[3].seed_bounds, adv.CANDIDATES[3].seed_finding)


def test_published_errors_come_from_the_codec() -> None:
    """``lowbit codecs`` prints the paper's figure beside its own where the codec has one: Dettmers' Table 2,
    for his 2015 kernels (search=paper) only."""
    paper = get_codec("dettmers:type=linear,search=paper")
    assert paper.published_error("N(0,1)") == 6.47 and paper.published_error("gradients") is None
    assert get_codec("dettmers:type=linear").published_error("N(0,1)") is None
    assert get_codec("dettmers:type=dynamic_bnb").published_error("N(0,1)") is None
    assert get_codec("qsgd").published_error("N(0,1)") is None
