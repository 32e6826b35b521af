"""benchmarks/validate_cross_card.py (issue 18) on copies of the committed bench_ddp files (tests/fixtures/):
structure, not accuracy.

The held-out network is never in a fit, every cell gets a finite prediction, and the predicted card's
sockets rows never reach a prediction (poisoned or scaled, the predictions do not move)."""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "validate_cross_card.py"
FIXTURES = ROOT / "tests" / "fixtures"
#: copies of the script's DEFAULT_FILES (benchmarks/results/), per card: sockets, NVLink
FILES = {"H100": (FIXTURES / "ddp_2xh100_sockets.json", FIXTURES / "ddp_2xh100_nvlink.json"),
         "H200": (FIXTURES / "ddp_2xh200_sockets.json", FIXTURES / "ddp_2xh200_nvlink.json")}


@pytest.fixture(scope="module")
def vcc():
    spec = importlib.util.spec_from_file_location("validate_cross_card", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["validate_cross_card"] = mod
    spec.loader.exec_module(mod)
    # structure, not accuracy: a coarser grid for the fits (the script's 13 points x 4 rounds take ~10 s)
    mod.GRID_POINTS, mod.GRID_ROUNDS = 5, 2
    return mod


@pytest.fixture(scope="module")
def cards(vcc):
    return {k: vcc.load_card(k, *files) for k, files in FILES.items()}


@pytest.fixture(scope="module")
def result(vcc, cards):
    return vcc.run(cards, reference=False)


def _scaled(card, factor, networks=None):
    c = copy.deepcopy(card)
    for net, row in c.sockets_ms.items():
        if networks is None or net in networks:
            for codec in row:
                row[codec] *= factor
    return c


def _pred(rows, direction):
    return {(r["network"], r["codec"]): r["predicted_ms"] for r in rows
            if f"{r['fit_card']}->{r['predicted_card']}" == direction}


class _Poison(dict):
    def __getitem__(self, k):
        raise AssertionError("a predicted card's sockets row was read")

    get = items = values = keys = __iter__ = __contains__ = __len__ = __getitem__  # type: ignore[assignment]


def test_every_cell_predicted_finite_and_held_out(vcc, cards, result):
    cells = result["cells"]
    nets = {"vgg19", "resnet50", "alexnet", "gpt2_small"}
    # 2 directions x 4 networks x 5 codecs, each present in both sockets files
    assert len(cells) == 2 * 4 * 5
    assert {r["network"] for r in cells} == nets
    assert {r["codec"] for r in cells} == set(vcc.HOOKS)
    for r in cells:
        assert math.isfinite(r["predicted_ms"]) and r["predicted_ms"] > 0
        assert r["predicted_ms"] >= r["compute_ms"] > 0          # the link only adds to the compute
        # the compute is the predicted card's own plain-DDP NVLink step
        assert r["compute_ms"] == pytest.approx(cards[r["predicted_card"]].nvlink_ms[r["network"]])
        # fitted on the other card only, on the three other networks only
        assert r["fit_card"] != r["predicted_card"]
        assert sorted(r["fitted_on"]) == sorted(f"{r['fit_card']}:{n}" for n in nets - {r["network"]})
    for k in ("H100->H200", "H200->H100", "overall"):
        assert result["summary"][k]["cells"] in (20, 40)
        assert math.isfinite(result["summary"][k]["median_abs_error"])


@pytest.mark.slow
def test_predicted_cards_sockets_rows_scaled_move_only_the_other_direction(vcc, cards, result):
    """A second whole run (~5 s). Fast equivalent: test_predicted_cards_sockets_rows_never_read (the
    predicted card's rows poisoned: any read fails)."""
    # scaled: the other direction's fit changes, this direction's predictions do not
    scaled = {"H100": cards["H100"], "H200": _scaled(cards["H200"], 3.0)}
    again = vcc.run(scaled, reference=False)
    assert _pred(again["cells"], "H100->H200") == _pred(result["cells"], "H100->H200")
    assert _pred(again["cells"], "H200->H100") != _pred(result["cells"], "H200->H100")


def test_predicted_cards_sockets_rows_never_read(vcc, cards, result):
    """Stands in, in the default run, for test_predicted_cards_sockets_rows_scaled_move_only_the_other_direction
    (slow): the same property checked directly, without a second whole run."""
    # poisoned: any read of the predicted card's sockets rows fails
    target = copy.deepcopy(cards["H200"])
    target.sockets_ms, target.sockets_raw_ms = _Poison(), _Poison()
    nets = list(cards["H200"].nvlink_ms)
    rows = vcc.cross_card(cards["H100"], vcc.target_of(target), nets, fits=result["fits"]["H100"])
    assert {(r["network"], r["codec"]): r["predicted_ms"] for r in rows} == _pred(result["cells"], "H100->H200")


def test_held_out_network_absent_from_fit(vcc, cards, result):
    # the fitting card's vgg19 sockets cells scaled: the fit that predicts vgg19 does not move
    others = ["resnet50", "alexnet", "gpt2_small"]
    scaled = vcc.fit(_scaled(cards["H100"], 3.0, networks={"vgg19"}), others)
    assert scaled == result["fits"]["H100"]["vgg19"]
    assert scaled.fitted_on == ("H100:alexnet", "H100:gpt2_small", "H100:resnet50")
    for net, p in result["fits"]["H100"].items():  # every leave-one-out fit: its network absent
        assert f"H100:{net}" not in p.fitted_on and len(p.fitted_on) == 3


def test_hook_messages_follow_the_code_that_ran(vcc, cards):
    # ddp_runs.md: the H100 files' git_commit is stale (the hook coalesced DDP buckets, 64 MiB); H200: groups
    assert cards["H100"].messages == ("buckets", 64.0)
    assert cards["H200"].messages == ("tensors", vcc.LEGACY_AUTO)  # b534a38: auto was the size rule then
    assert vcc.hook_messages({"git_commit": "c0fc04b"}) == ("tensors", "auto")  # (git history permitting)
    assert vcc.hook_messages({"git_commit": "b534a38", "args": {"lowbit_message_mb": 32}}) == ("tensors", 32.0)
