"""The adapters' options (lowbit.integrations._register), checked when an adapter is built, before the
framework has chosen DDP or FSDP2: no processes, no framework (an FSDP2 model refusing a DDP option:
tests/distributed/test_integrations.py::test_accelerate_register_serves_ddp_and_fsdp2_models)."""

from __future__ import annotations

import pytest
from torch import nn

import lowbit.ddp
import lowbit.fsdp
from lowbit.integrations._register import check_options, register_built


def test_options_neither_register_takes_fail_at_construction_naming_both() -> None:
    with pytest.raises(TypeError, match=r"adapter: these options fit neither lowbit.ddp.register .*'codex'.* nor "
                                        r"lowbit.fsdp.register .*'codex'"):
        check_options(None, {"codex": "qsgd:bits=8"}, "adapter")
    with pytest.raises(ValueError, match=r"^adapter: qsgd: bits=99 is out of range"):  # the same word once
        check_options(None, {"codec": "qsgd:bits=99"}, "adapter")
    with pytest.raises(ValueError, match="config must be a lowbit.ddp.DDPConfig or a lowbit.fsdp.FSDPConfig"):
        check_options({"codec": "fp16"}, {}, "adapter")


def test_options_of_one_register_are_refused_when_the_other_serves() -> None:
    """DDP's algorithm= is no FSDP option: accepted when built (the framework may build DDP), refused with
    FSDP's word when the model turns out sharded; a config serves its own register only."""
    opts = check_options(None, {"algorithm": "allgather"}, "adapter")
    assert opts.ddp is not None and opts.fsdp is None
    fsdp_only = check_options(lowbit.fsdp.FSDPConfig(codec="qsgd:bits=4"), {}, "adapter")
    assert fsdp_only.ddp is None and fsdp_only.fsdp.codec == "qsgd:bits=4"
    assert check_options(lowbit.ddp.DDPConfig(codec="fp16"), {}, "adapter").fsdp is None
    assert register_built(nn.Linear(2, 2), opts) is None  # neither wrapper: nothing installed

