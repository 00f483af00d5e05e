"""The demo's model: a small GPT-style byte-level language model.

Pre-norm transformer blocks (causal self-attention through
``F.scaled_dot_product_attention``, a 4x GELU MLP), learned positions, an
untied output head. The default size (width 128, 4 blocks, 64-byte context,
0.87M parameters) is the demo's: small enough to train six runs side by side
on two CPU cores in a couple of minutes. ``--long`` trains width 256 (3.3M).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from demo_data import VOCAB
from torch import nn


@attrs.frozen
class ModelConfig:
    """The model's shape."""

    width: int = 128
    layers: int = 4
    heads: int = 4
    context: int = 64


class Block(nn.Module):
    """Pre-norm causal self-attention, then a 4x GELU MLP, each residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            part.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for part in self.qkv(self.ln1(x)).split(c, dim=2)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        y: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return y


class TinyGPT(nn.Module):
    """Bytes in, next-byte logits out."""

    def __init__(self, config: ModelConfig = ModelConfig()) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.blocks = nn.Sequential(
            *(Block(config.width, config.heads) for _ in range(config.layers))
        )
        self.ln = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, VOCAB)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        logits: torch.Tensor = self.head(self.ln(self.blocks(x)))
        return logits


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats (computed in float32 whatever the
    model's dtype)."""
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def eval_windows(text: torch.Tensor, context: int, windows: int) -> torch.Tensor:
    """``windows`` evenly spaced, non-overlapping windows of ``context + 1``
    tokens of ``text`` (inputs and next-byte targets), as rows; fewer if
    ``text`` is too short for that many."""
    stride = max(context + 1, (len(text) - context - 1) // windows)
    starts = range(0, len(text) - context - 1, stride)
    return torch.stack([text[s : s + context + 1] for s in starts][:windows]).long()


@torch.no_grad()
def held_out_loss(model: nn.Module, text: torch.Tensor, context: int, windows: int = 64) -> float:
    """Mean loss over ``windows`` evenly spaced, non-overlapping windows of ``text``."""
    data = eval_windows(text, context, windows)
    return lm_loss(model(data[:, :-1]), data[:, 1:]).item()


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: bytes,
    length: int,
    context: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> bytes:
    """``length`` bytes sampled after ``prompt`` (seeded, so both runs draw
    the same random numbers)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([list(prompt)], dtype=torch.long)
    for _ in range(length):
        logits = model(tokens[:, -context:])[0, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, dim=0), 1, generator=generator)
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    return bytes(tokens[0, len(prompt) :].tolist())
