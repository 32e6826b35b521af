"""The checkpoint of :class:`~lowbit.localsgd.LocalSGD`: :meth:`_Checkpoint.state_dict` and
:meth:`_Checkpoint.load_state_dict`, this rank's state beyond the model and the inner optimizer (the
step within the schedule, the anchors, the exchanges in flight, the outer optimizer's state, the
error-feedback residuals), checked whole before anything changes."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lowbit.comm.stats import CommStats
from lowbit.feedback import ErrorFeedback

#: the checkpoint format of :meth:`LocalSGD.state_dict <lowbit.localsgd.LocalSGD.state_dict>`
_FORMAT = "lowbit.localsgd/1"


class _Checkpoint:
    """The checkpoint of :class:`~lowbit.localsgd.LocalSGD` (a mixin: the attributes it reads are set by
    :meth:`LocalSGD._configure <lowbit.localsgd.core.LocalSGD._configure>`)."""

    def _settings(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.config), "fragment_sizes": [fr.numel for fr in self._frags],
                "outer": type(self.outer).__name__}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (residuals differ between ranks: save every rank's): the step within the
        schedule, the anchors, the outer optimizer's state, the error-feedback residuals. The model's
        weights and the inner optimizer's state are saved by their own ``state_dict``.

        Returns:
            A dict of CPU tensors and plain values (``torch.save``-able).
        """
        return {
            "format": _FORMAT,
            "settings": self._settings(),
            "step": self._step,
            "skipped": self.skipped,
            "anchors": [fr.anchor.detach().to("cpu").clone() for fr in self._frags],
            # overlap: the exchanges in flight, landed locally (each its reduced chunk and the step it is due)
            "pending": {f: (self._landed(f).to("cpu").clone(), due)
                        for f, (_, _, due) in sorted(self._pending.items())},
            "outer": self.outer.state_dict(),
            "feedback": self.feedback.state_dict() if self.feedback is not None else None,
            "stats": self.stats.as_dict(),
        }

    def _landed(self, f: int) -> torch.Tensor:
        """Fragment ``f``'s delta in flight, its exchange waited for (it lands at its step as planned)."""
        entry = self._pending[f]
        if entry[0] is not None:
            entry[0].wait()
            entry[0] = None
        return entry[1]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` (all checked before anything changes). With the model's and the inner
        optimizer's states loaded too, training continues bit-identically.

        Args:
            state: what :meth:`state_dict` returned (on this rank).

        Raises:
            ValueError: not a local SGD checkpoint, saved with other settings (named), anchors of the wrong
                size or dtype, residuals refused by :func:`lowbit.feedback.load_residuals`.
        """
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"not a lowbit.localsgd checkpoint (format {_FORMAT!r}): got "
                             f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}")
        saved, mine = state.get("settings"), self._settings()
        if saved != mine:
            diff = {k: (saved.get(k) if isinstance(saved, dict) else None, v) for k, v in mine.items()
                    if not isinstance(saved, dict) or saved.get(k) != v}
            raise ValueError("lowbit.localsgd checkpoint was saved with other settings: "
                             + ", ".join(f"{k} saved {a!r}, now {b!r}" for k, (a, b) in diff.items()))
        anchors = state.get("anchors")
        if not isinstance(anchors, list) or len(anchors) != len(self._frags):
            raise ValueError(f"lowbit.localsgd checkpoint: expected {len(self._frags)} anchors")
        for i, (a, fr) in enumerate(zip(anchors, self._frags)):
            if not isinstance(a, torch.Tensor) or a.dtype != torch.float32 or a.numel() != fr.numel:
                raise ValueError(f"lowbit.localsgd checkpoint: anchor {i} must be a float32 tensor of {fr.numel} values")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"lowbit.localsgd checkpoint: 'step' must be an int >= 0, got {step!r}")
        pending = state.get("pending", {})

        def bad(f: Any, v: Any) -> bool:
            return (not (isinstance(f, int) and 0 <= f < len(self._frags)) or not isinstance(v, (tuple, list))
                    or len(v) != 2 or not isinstance(v[0], torch.Tensor) or v[0].dtype != torch.float32
                    or v[0].numel() != self._frags[f].padded or not isinstance(v[1], int)
                    or not step < v[1] <= step + self.config.overlap)

        if not isinstance(pending, dict) or any(bad(f, v) for f, v in pending.items()):
            raise ValueError("lowbit.localsgd checkpoint: 'pending' must map fragments to (their padded float32 delta, "
                             "a due step within overlap of 'step')")
        fb = state.get("feedback")
        if (fb is None) != (self.feedback is None):
            raise ValueError("lowbit.localsgd checkpoint: error feedback was "
                             f"{'off' if fb is None else 'on'} when saved, {'off' if self.feedback is None else 'on'} now")
        if self.feedback is not None:
            c = {f: fr.padded // self._chunks for f, fr in enumerate(self._frags)}
            trial = ErrorFeedback(self.codec)
            trial.load_state_dict(fb, device=self._scratch.device, numels=c)  # checked whole first
        # everything checked: apply
        with torch.no_grad():
            for a, fr in zip(anchors, self._frags):
                fr.anchor.copy_(a)
        self.outer.load_state_dict(state["outer"])
        if self.feedback is not None:
            self.feedback.residuals = trial.residuals
        self._step = step
        self._pending = {f: [None, v[0].to(self._scratch.device).clone(), v[1]] for f, v in pending.items()}
        self.skipped = int(state.get("skipped", 0))
        stats = state.get("stats")
        if isinstance(stats, dict):
            self.stats = CommStats(**{k: v for k, v in stats.items() if k in CommStats.__dataclass_fields__})
