"""AN4 (CMU's alphanumeric speech set) from its WAV files and transcripts, as frames for the seed's LSTM.

Layout under ``data_dir`` (CMU's ``an4`` folder, WAV version)::

    etc/an4_train.fileids          an4_clstk/fash/an251-fash-b      (one utterance per line)
    etc/an4_train.transcription    <s> YES </s> (an251-fash-b)
    etc/an4_test.fileids           an4test_clstk/fcaw/cen1-fcaw-b
    etc/an4_test.transcription
    wav/<fileid>.wav               16 kHz, 16-bit, mono

Features are CNTK's AN4 example's: 33 log mel filterbank energies per 10 ms frame (25 ms Hamming window,
512-point FFT, 0-8 kHz), standardised per dimension on the training utterances, spliced over 11 frames
(5 either side) into the 363 inputs of :class:`lowbit.lab.models.LSTMP`. CNTK trains on senone labels from a
forced alignment that AN4 does not ship; here each frame is labelled with the transcript's character
under a *flat start* (the characters, with ``_`` for the silences between and around words, spread evenly
over the utterance's frames: the uniform alignment HMM training starts from). Utterances are cut into
windows of ``window`` frames (16: CNTK's truncated-BPTT length); ``y`` is one character id per frame
(``task = "sequence"``), and the vocabulary is in ``meta["vocab"]``. ``max_train`` / ``max_test`` keep the
first N utterances.
"""

from __future__ import annotations

import os
import re
import wave
from pathlib import Path

import numpy as np
import torch

from lowbit.lab.data.bundle import Dataset
from lowbit.lab.data.ondisk import _data_dir

__all__ = ["load_an4", "log_mel", "SAMPLE_RATE", "MEL_BANDS", "CONTEXT"]

SAMPLE_RATE = 16_000
MEL_BANDS = 33
CONTEXT = 5  # frames either side: 11 x 33 = 363 features
_WIN, _HOP, _NFFT = 400, 160, 512
_LAYOUT = ("CMU's an4 folder (WAV version): etc/an4_train.fileids, etc/an4_train.transcription, "
           "etc/an4_test.fileids, etc/an4_test.transcription and wav/<fileid>.wav (16 kHz, 16-bit mono)")
_LINE = re.compile(r"^\s*(?:<s>)?\s*(?P<text>.*?)\s*(?:</s>)?\s*\((?P<utt>[^()]+)\)\s*$")


def _mel_filters() -> np.ndarray:
    def mel(f: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def hz(m: np.ndarray) -> np.ndarray:
        return 700.0 * (10 ** (m / 2595.0) - 1.0)

    edges = hz(np.linspace(mel(np.array(0.0)), mel(np.array(SAMPLE_RATE / 2)), MEL_BANDS + 2))
    bins = np.fft.rfftfreq(_NFFT, 1 / SAMPLE_RATE)
    fb = np.zeros((MEL_BANDS, bins.size), dtype=np.float64)
    for i in range(MEL_BANDS):
        lo, mid, hi = edges[i], edges[i + 1], edges[i + 2]
        fb[i] = np.clip(np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), 0.0, None)
    return fb


_FB = _mel_filters()


def log_mel(samples: np.ndarray) -> np.ndarray:
    """(frames, 33) log mel filterbank energies of 16 kHz samples (float, any scale)."""
    x = np.asarray(samples, dtype=np.float64)
    if x.size < _WIN:
        x = np.pad(x, (0, _WIN - x.size))
    n = 1 + (x.size - _WIN) // _HOP
    idx = np.arange(_WIN)[None, :] + _HOP * np.arange(n)[:, None]
    frames = x[idx] * np.hamming(_WIN)[None, :]
    power = np.abs(np.fft.rfft(frames, _NFFT)) ** 2
    return np.log(power @ _FB.T + 1e-8).astype(np.float32)


def _read_wav(path: Path) -> np.ndarray:
    try:
        with wave.open(str(path), "rb") as w:
            if w.getnchannels() != 1 or w.getsampwidth() != 2 or w.getframerate() != SAMPLE_RATE:
                raise ValueError(f"{path}: {w.getnchannels()} channel(s), {8 * w.getsampwidth()}-bit, "
                                 f"{w.getframerate()} Hz; AN4 is 1 channel, 16-bit, {SAMPLE_RATE} Hz")
            data = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{path}: not a WAV file ({exc})") from None
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def _utterances(root: Path, split: str, limit: int) -> list[tuple[Path, str]]:
    ids_file, trans_file = root / "etc" / f"an4_{split}.fileids", root / "etc" / f"an4_{split}.transcription"
    for f in (ids_file, trans_file):
        if not f.is_file():
            raise ValueError(f"{root}: no {f.relative_to(root)}; expected {_LAYOUT}")
    texts = {}
    for n, line in enumerate(trans_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"{trans_file}:{n}: expected '<s> WORDS </s> (utterance-id)', got {line.strip()!r}")
        texts[m["utt"].strip()] = m["text"].strip()
    out = []
    for fid in (s.strip() for s in ids_file.read_text().splitlines()):
        if not fid:
            continue
        utt = fid.rsplit("/", 1)[-1]
        if utt not in texts:
            raise ValueError(f"{trans_file}: no transcript for {utt} (listed in {ids_file.name})")
        wav = root / "wav" / f"{fid}.wav"
        if not wav.is_file():
            raise ValueError(f"{root}: no wav/{fid}.wav; expected {_LAYOUT}")
        out.append((wav, texts[utt]))
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{ids_file}: lists no utterance")
    return out


def _flat_start(text: str, frames: int) -> list[str]:
    chars = "_" + "_".join(text.upper().split()) + "_"
    return [chars[min(len(chars) - 1, t * len(chars) // frames)] for t in range(frames)]


def _splice(feats: np.ndarray) -> np.ndarray:
    padded = np.pad(feats, ((CONTEXT, CONTEXT), (0, 0)), mode="edge")
    return np.concatenate([padded[i : i + feats.shape[0]] for i in range(2 * CONTEXT + 1)], axis=1)


def load_an4(seed: int = 0, data_dir: str | os.PathLike[str] | None = None, window: int = 16, max_train: int = 0,
             max_test: int = 0) -> Dataset:
    """AN4 as spliced log-mel frames with flat-start character labels (module doc)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"an4: window must be an int >= 1 (frames per training window), got {window!r}")
    root = _data_dir("an4", data_dir, _LAYOUT)
    splits = {s: _utterances(root, s, lim) for s, lim in (("train", max_train), ("test", max_test))}
    feats = {s: [log_mel(_read_wav(w)) for w, _ in utts] for s, utts in splits.items()}
    labels = {s: [_flat_start(t, f.shape[0]) for (_, t), f in zip(splits[s], feats[s])] for s in splits}
    vocab = sorted({c for s in labels for lab in labels[s] for c in lab})
    train_all = np.concatenate(feats["train"])
    mean, std = train_all.mean(axis=0), train_all.std(axis=0)
    std[std == 0] = 1.0
    xs, ys = {}, {}
    for s in splits:
        x_parts, y_parts = [], []
        for f, lab in zip(feats[s], labels[s]):
            spliced = _splice((f - mean) / std)
            ids = np.array([vocab.index(c) for c in lab], dtype=np.int64)
            n = f.shape[0] // window
            if n:
                x_parts.append(spliced[: n * window].reshape(n, window, -1))
                y_parts.append(ids[: n * window].reshape(n, window))
        if not x_parts:
            raise ValueError(f"an4: no {s} utterance is {window} frames long ({window * _HOP / SAMPLE_RATE:.2f} s)")
        xs[s], ys[s] = np.concatenate(x_parts), np.concatenate(y_parts)
    dim = MEL_BANDS * (2 * CONTEXT + 1)
    return Dataset(
        name="an4",
        label=f"AN4 {len(splits['train'])} / {len(splits['test'])} utterances as {window}-frame windows of "
              f"{dim} features, flat-start character labels ({len(vocab)} symbols, from {root})",
        x_train=torch.from_numpy(xs["train"]), y_train=torch.from_numpy(ys["train"]),
        x_test=torch.from_numpy(xs["test"]), y_test=torch.from_numpy(ys["test"]),
        num_classes=len(vocab),
        in_shape=(window, dim),
        synthetic=False,
        source=f"AN4 WAV files and transcripts in {root}",
        task="sequence",
        meta={"vocab": vocab, "mean": mean.tolist(), "std": std.tolist(), "data_dir": str(root),
              "labels": "flat start (uniform alignment of the transcript's characters)"},
    )
