"""The seed's 3-layer LSTM (AN4 speech, "13M" parameters), as CNTK's AN4 example defines it.

The seed trains "a network that consists of 3 long short-term memory (LSTM) components", built by
CNTK, on AN4 with batch size 16 and learning rate 0.5. That is CNTK's
``Examples/Speech/AN4/Config/lstmp-3layer-opt.ndl`` (network ``LSTMP_c1024_p256_x3``, minibatch 16,
learning rate 0.5 per minibatch): a frame-level acoustic model

    363 features (33 filterbank coefficients x 11 frames of context)
    -> 3 x LSTMP (1024 memory cells, recurrent projection to 512, peepholes)
    -> dense 512 -> 132 senone classes, softmax per frame.

CNTK's count is 13,634,692 parameters (the seed's table rounds down to "13M"). We use
``torch.nn.LSTM(hidden_size=1024, proj_size=512)`` so cuDNN runs it; that differs in two small
ways, both documented and neither changing what is communicated materially: torch has two bias
vectors per layer where CNTK has one (+4096 per layer), and no peephole weights (-3072 per layer).
Our count is 13,637,764 (+0.02%). The per-layer gradient tensors therefore have CNTK's shapes
(4096x363, 4096x512, 512x1024, ...) apart from the biases.

Input: ``(N, T, 363)`` float features (normalise them beforehand; CNTK's ``MeanVarNorm`` is a fixed
per-dimension standardisation with no trainable parameters). With ``in_shape=(T,)`` the model reads
``(N, T)`` integer tokens through an embedding of ``input_dim`` (363 by default, so the recurrent
core keeps the seed's shapes) and predicts the next token: the offline text corpus in
:mod:`lowbit.lab.data` uses it that way, with ``num_classes`` = vocabulary size. Output: ``(N, T,
num_classes)`` logits per time step. ``T`` defaults to 16: CNTK reads this example's
``minibatchSize = 16`` with ``nbrUttsIneachRecurrentIter = 16`` as truncated-BPTT windows of 16
frames from 16 utterances in parallel.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LSTMP", "AN4_FEATURES", "AN4_SENONES"]

#: CNTK AN4 example: 33 log filterbank coefficients spliced over 11 frames.
AN4_FEATURES = 363
#: CNTK AN4 example: tied HMM states (``state.list``).
AN4_SENONES = 132


class LSTMP(nn.Module):
    """Stacked LSTM with recurrent projection and a per-time-step dense output layer."""

    def __init__(
        self,
        num_classes: int = AN4_SENONES,
        input_dim: int = AN4_FEATURES,
        cell_dim: int = 1024,
        proj_dim: int = 512,
        num_layers: int = 3,
        vocab_size: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        # Tokens in (language modelling) -> an embedding in front of the same recurrent core.
        self.embedding = nn.Embedding(vocab_size, input_dim) if vocab_size else None
        self.lstm = nn.LSTM(
            input_size=input_dim,
            hidden_size=cell_dim,
            proj_size=proj_dim,
            num_layers=num_layers,
            batch_first=True,
            dropout=dropout,
        )
        self.output = nn.Linear(proj_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, T, input_dim) float features, or (N, T) token ids -> (N, T, num_classes)."""
        if self.embedding is not None:
            x = self.embedding(x)  # (N, T, input_dim)
        h, _ = self.lstm(x)  # (N, T, proj_dim)
        return self.output(h)
