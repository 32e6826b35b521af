"""One shape for DDP and FSDP (issue 42): ``register(model, *, config=None, **options)``, every option
keyword-only and validated once in a frozen config (``DDPConfig``, ``FSDPConfig``), codec="auto"'s shared
options written once (``AutoOptions``, the base of both). No process group needed."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from torch import nn

import lowbit.ddp as D
import lowbit.fsdp as lf
from lowbit.auto.options import AutoOptions


def _positional(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def test_options_are_keyword_only_and_the_config_is_their_one_list() -> None:
    assert _positional(D.register) == ["ddp_model"]
    assert _positional(lf.register) == ["model"]
    assert _positional(D.make_state) == ["module", "codec"]  # (the codec second, as the tests have always passed it)
    for fn in (D.register, lf.register, D.make_state):
        params = inspect.signature(fn).parameters
        assert "config" in params and any(p.kind is p.VAR_KEYWORD for p in params.values())
        # no option written again in the signature: the config's fields are the list
        assert not {f.name for f in dataclasses.fields(D.DDPConfig)} - {"codec"} & set(params)


def test_an_unknown_option_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"DDPConfig has no option 'codecs'"):
        D.make_state(nn.Linear(4, 4), codecs="fp16")
    with pytest.raises(TypeError, match=r"FSDPConfig has no option 'param_codecs'"):
        lf.register(nn.Linear(4, 4), param_codecs="fp16")


def test_auto_options_are_written_once_for_both() -> None:
    shared = {f.name for f in dataclasses.fields(AutoOptions)}
    assert shared == {"auto_level", "guard_every", "allow", "error_budget"}
    for cls in (D.DDPConfig, lf.FSDPConfig):
        assert issubclass(cls, AutoOptions) and shared <= {f.name for f in dataclasses.fields(cls)}
    assert set(D.DDPConfig.auto_names()) == shared | {"measure_steps", "remeasure_every"}
    assert set(lf.FSDPConfig.auto_names()) == shared


def test_fsdp_config_is_frozen_keyword_only_and_validated_once() -> None:
    with pytest.raises(TypeError):
        lf.FSDPConfig("qsgd:bits=8")  # type: ignore[misc]
    cfg = lf.FSDPConfig(codec="auto", allow=["bf16"], auto_level="bold")
    assert cfg.allow == ("bf16",) and cfg.auto and cfg.gradient_codec() is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.codec = "fp16"  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown codec 'qsgd8'"):  # (as get_codec says it, on every path)
        lf.FSDPConfig(codec="qsgd8")
    for bad, match in [(dict(error_feedback=1), "error_feedback"),
                       (dict(node_size=0), "node_size"), (dict(codec="onebit:bucket=0"), "bucketed codec"),
                       (dict(param_codec=3), "param_codec must be"), (dict(codec="auto", guard_every=-1), "guard_every")]:
        with pytest.raises(ValueError, match=f"lowbit.fsdp.register: .*{match}"):
            lf.FSDPConfig(**bad)
    with pytest.raises(ValueError, match="not both"):
        lf.FSDPConfig.of(cfg, codec="bf16")
    with pytest.raises(ValueError, match="fully_shard"):  # a config is taken as it is: on to the model's checks
        lf.register(nn.Linear(4, 4), config=lf.FSDPConfig(codec="bf16", param_codec="bf16"))


def test_auto_options_given_with_another_codec_are_named() -> None:
    with pytest.raises(ValueError, match=r"go with codec='auto', but codec is 'fp16' and guard_every=0 was given"):
        D.DDPConfig(codec="fp16", guard_every=0)
    with pytest.raises(ValueError, match=r"lowbit.fsdp.register: .* but codec is 'qsgd:bits=8' and auto_level='bold'"):
        lf.FSDPConfig(codec="qsgd:bits=8", auto_level="bold")


def test_public_entry_points_document_args_returns_and_raises() -> None:
    """STYLE: Args: / Returns: / Raises: on every public entry point (read from the source, so the optional
    Lightning and Accelerate adapters need not be installed)."""
    import ast
    from pathlib import Path

    src = Path(D.__file__).parents[1]  # (lowbit/ddp/__init__.py -> lowbit/)
    wanted = {"ddp/__init__.py": ["register", "make_state"], "fsdp/__init__.py": ["register"], "comm/allreduce.py": ["all_reduce"],
              "codecs/base.py": ["get_codec"], "integrations/accelerate.py": ["register"],
              "integrations/lightning.py": ["LowbitCallback"]}
    for path, names in wanted.items():
        tree = ast.parse((src / path).read_text())
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for name in names:
            doc = ast.get_docstring(defs[name]) or ""
            sections = ["Args:", "Raises:"] + ([] if isinstance(defs[name], ast.ClassDef) else ["Returns:"])
            assert all(s in doc for s in sections), (path, name, [s for s in sections if s not in doc])


def test_fsdp_error_feedback_defaults_as_ddp() -> None:
    """One default for both (issue 42): error feedback "auto" is on for biased codecs only."""
    from lowbit.ddp import DDPConfig
    from lowbit.fsdp import FSDPConfig

    for spec, biased in (("onebit:bucket=64", True), ("topk", True), ("qsgd:bits=4,bucket=512", False),
                         ("bf16", False)):
        assert FSDPConfig(codec=spec).uses_feedback() is biased, spec
        assert DDPConfig().error_feedback == FSDPConfig().error_feedback == "auto"
    assert FSDPConfig(codec="qsgd:bits=2,bucket=128", error_feedback=True).uses_feedback()
    assert not FSDPConfig(codec="onebit:bucket=64", error_feedback=False).uses_feedback()
    assert not FSDPConfig(codec="auto").uses_feedback()  # (auto's tuner keeps its own)
    with pytest.raises(ValueError, match="error_feedback must be True, False or 'auto'"):
        FSDPConfig(error_feedback="yes")
