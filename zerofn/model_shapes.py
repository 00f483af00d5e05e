"""Parameter shapes of well-known models, for capacity planning without the
models' packages (and without allocating them).

Each function returns the shapes of the model's trainable parameters in
registration order, as its reference implementation declares them (Hugging
Face ``transformers`` for GPT-2, BERT and Llama, ``torchvision`` for
ResNet-50); the totals are checked in the tests against the published counts.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["MODELS", "bert_base", "gpt2_small", "llama_7b", "resnet50"]

Shape = tuple[int, ...]


def gpt2_small() -> list[Shape]:
    """GPT-2 small (124,439,808 parameters; the LM head shares the embedding)."""
    d, ff, vocab, ctx = 768, 3072, 50257, 1024
    shapes: list[Shape] = [(vocab, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]  # ln_1, attention
        shapes += [(d,), (d,), (d, ff), (ff,), (ff, d), (d,)]  # ln_2, MLP
    return [*shapes, (d,), (d,)]


def bert_base() -> list[Shape]:
    """BERT-base, uncased, with its pooler (109,482,240 parameters)."""
    d, ff = 768, 3072
    shapes: list[Shape] = [(30522, d), (512, d), (2, d), (d,), (d,)]
    for _ in range(12):
        shapes += [(d, d), (d,)] * 4 + [(d,), (d,)]  # q, k, v, output; LayerNorm
        shapes += [(ff, d), (ff,), (d, ff), (d,), (d,), (d,)]  # MLP; LayerNorm
    return [*shapes, (d, d), (d,)]


def _bottleneck(inplanes: int, planes: int, downsample: bool) -> list[Shape]:
    out = planes * 4
    shapes: list[Shape] = [(planes, inplanes, 1, 1), (planes,), (planes,)]
    shapes += [(planes, planes, 3, 3), (planes,), (planes,)]
    shapes += [(out, planes, 1, 1), (out,), (out,)]
    if downsample:
        shapes += [(out, inplanes, 1, 1), (out,), (out,)]
    return shapes


def resnet50() -> list[Shape]:
    """ResNet-50 for 1,000 classes (25,557,032 parameters)."""
    shapes: list[Shape] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += _bottleneck(inplanes, planes, downsample=block == 0)
            inplanes = planes * 4
    return [*shapes, (1000, 2048), (1000,)]


def llama_7b() -> list[Shape]:
    """Llama-2-7B (6,738,415,616 parameters; untied LM head)."""
    d, ff, vocab = 4096, 11008, 32000
    shapes: list[Shape] = [(vocab, d)]
    for _ in range(32):
        shapes += [(d, d)] * 4 + [(ff, d), (ff, d), (d, ff), (d,), (d,)]
    return [*shapes, (d,), (vocab, d)]


MODELS: dict[str, Callable[[], list[Shape]]] = {
    "gpt2-small": gpt2_small,
    "bert-base": bert_base,
    "resnet50": resnet50,
    "llama-7b": llama_7b,
}
"""The built-in models of ``python -m zerofn.footprint --model NAME``."""
