"""lowbit.lab.data.speech on small files generated in AN4's on-disk layout (WAVs + fileids + transcriptions)."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from lowbit.lab.data import load_dataset
from lowbit.lab.data.speech import CONTEXT, MEL_BANDS, SAMPLE_RATE, log_mel

UTTS = {"train": [("an4_clstk/fash/an251-fash-b", "YES"), ("an4_clstk/fash/an253-fash-b", "GO"),
                  ("an4_clstk/mgah/cen2-mgah-b", "RUBOUT G M")],
        "test": [("an4test_clstk/fcaw/an406-fcaw-b", "NO")]}


def _tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")


def _make(root: Path) -> None:
    (root / "etc").mkdir(parents=True)
    for split, utts in UTTS.items():
        ids, trans = [], []
        for i, (fid, text) in enumerate(utts):
            wav = root / "wav" / f"{fid}.wav"
            wav.parent.mkdir(parents=True, exist_ok=True)
            with wave.open(str(wav), "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(SAMPLE_RATE)
                w.writeframes(_tone(0.5 + 0.25 * i, 300 + 200 * i).tobytes())
            ids.append(fid)
            trans.append(f"<s> {text} </s> ({fid.rsplit('/', 1)[-1]})")
        (root / "etc" / f"an4_{split}.fileids").write_text("\n".join(ids) + "\n")
        (root / "etc" / f"an4_{split}.transcription").write_text("\n".join(trans) + "\n")


def test_reads_the_layout_into_lstm_frames(tmp_path: Path) -> None:
    _make(tmp_path)
    ds = load_dataset("an4", data_dir=tmp_path)
    assert ds.task == "sequence" and ds.in_shape == (16, MEL_BANDS * (2 * CONTEXT + 1)) == (16, 363)
    # frames: 1 + (samples - 400) // 160 per utterance; whole 16-frame windows
    frames = [1 + (int((0.5 + 0.25 * i) * SAMPLE_RATE) - 400) // 160 for i in range(3)]
    assert ds.x_train.shape[0] == sum(f // 16 for f in frames) and ds.y_train.shape == ds.x_train.shape[:2]
    assert ds.meta["vocab"] == sorted(set("_YES_GO_RUBOUT_G_M_NO"))
    # flat start: the first frames are silence, then the transcript's characters in order
    first = [ds.meta["vocab"][i] for i in ds.y_train[0].tolist()]
    assert first[0] == "_" and set(first) <= set("_YES")
    # standardised on the training frames (the centre frame of the splice is the frame itself)
    centre = ds.x_train[..., CONTEXT * MEL_BANDS:(CONTEXT + 1) * MEL_BANDS].reshape(-1, MEL_BANDS)
    assert abs(float(centre.mean())) < 0.2
    # a 300 Hz tone puts its energy in a low mel band
    assert int(np.argmax(log_mel(_tone(0.5, 300).astype(np.float32)).mean(0))) < 8
    # the LSTM takes it
    from lowbit.lab.models import build_model

    model = build_model("lstm", num_classes=ds.num_classes, in_shape=ds.in_shape)
    assert model(ds.x_train[:2]).shape == (2, 16, ds.num_classes)


def test_a_wrong_layout_names_the_expected_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="an4_train.fileids"):
        load_dataset("an4", data_dir=tmp_path)
    _make(tmp_path)
    (tmp_path / "wav" / "an4_clstk" / "fash" / "an253-fash-b.wav").unlink()
    with pytest.raises(ValueError, match="no wav/an4_clstk/fash/an253-fash-b.wav"):
        load_dataset("an4", data_dir=tmp_path)
    (tmp_path / "wav" / "an4_clstk" / "fash" / "an253-fash-b.wav").write_bytes(b"RIFF....")
    with pytest.raises(ValueError, match="not a WAV"):
        load_dataset("an4", data_dir=tmp_path)
    (tmp_path / "etc" / "an4_test.transcription").write_text("NO an406-fcaw-b\n")
    with pytest.raises(ValueError, match="utterance-id"):
        load_dataset("an4", data_dir=tmp_path, max_train=1)
