"""A GPT-2-small-shaped causal decoder (plain PyTorch), for DDP throughput runs of a transformer.

Shape of GPT-2 small (Radford et al. 2019; the 124M checkpoint): vocabulary 50257, context 1024,
12 layers, 12 heads, width 768, GELU MLP of 4x width, pre-LayerNorm blocks, learned position
embeddings and a final LayerNorm. One deliberate difference: the language-model head is *untied*
from the token embedding (a separate 768x50257 matrix, no bias), so every parameter is its own
gradient tensor and a data-parallel step communicates 163,037,184 values — GPT-2 small's
124,439,808 plus the 38,597,376 of the head (the two biggest gradient tensors, 38.6M values each).

Attention is :func:`torch.nn.functional.scaled_dot_product_attention` with ``is_causal=True`` (flash /
memory-efficient kernels on GPU). Input: ``(N, T)`` int64 token ids with ``T <= context``. Output:
``(N, T, vocab)`` logits (the ``"sequence"`` convention of :mod:`lowbit.lab.models`: one prediction per
position; train with cross-entropy against the next tokens). No dropout by default.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "GPT2_VOCAB", "GPT2_CONTEXT"]

#: GPT-2's byte-pair vocabulary.
GPT2_VOCAB = 50257
#: GPT-2's context length (number of learned position embeddings).
GPT2_CONTEXT = 1024


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not a multiple of n_heads {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (N, T, C) -> (N, heads, T, C / heads)
        q, k, v = (z.view(n, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(n, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(approximate="tanh"),  # GPT-2's GELU
            nn.Linear(mlp_ratio * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Causal decoder: token + position embeddings, ``n_layers`` blocks, LayerNorm, untied head."""

    def __init__(
        self,
        vocab_size: int = GPT2_VOCAB,
        context: int = GPT2_CONTEXT,
        n_layers: int = 12,
        n_heads: int = 12,
        d_model: int = 768,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._init_weights(n_layers)

    @torch.no_grad()
    def _init_weights(self, n_layers: int) -> None:
        # GPT-2's initialisation: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2L).
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / (2 * n_layers) ** 0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx``: (N, T) token ids, T <= context -> (N, T, vocab) logits."""
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the context {self.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
