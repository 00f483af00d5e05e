"""Runs the Python examples of README.md and docs/*.md as tests (Sybil), so a
page cannot drift from the code: ``>>>`` examples as doctests, other
``python`` fences as code, each page's fences in one namespace, in order.

Every page starts with what its examples take for granted, as a reader's
training script would have it: a (one-rank gloo) process group, a small
``model`` (also named ``module`` and ``net``), batches in ``loader`` (and
``my_batches``), a ``loss_fn``, an ``optimizer``, and ``fresh_ddp()``; files
the examples write go to a temporary directory. A page adds what else it
needs in an invisible block (``<!-- invisible-code-block: python``); an
example that cannot run here (it needs 8 ranks, or is a signature, not a
call) is marked ``<!-- skip: next -->`` with the reason.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from doctest import ELLIPSIS, NORMALIZE_WHITESPACE
from typing import Any

import torch
import torch.distributed as dist
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from torch.nn.parallel import DistributedDataParallel as DDP

_STORE = tempfile.mkdtemp(prefix="zerofn-docs-")


def _one_rank_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{_STORE}/store", rank=0, world_size=1)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        yield torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)


def _loss_fn(output: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    if target is None:
        return output.square().mean()
    return torch.nn.functional.cross_entropy(output, target)


def _setup(namespace: dict[str, Any]) -> None:
    _one_rank_group()
    model = _model()
    namespace["_cwd"] = os.getcwd()
    os.chdir(tempfile.mkdtemp(prefix="zerofn-docs-page-"))
    namespace.update(
        torch=torch,
        dist=dist,
        DDP=DDP,
        model=model,
        module=model,
        net=model,
        loader=list(_batches()),
        my_batches=list(_batches()),
        loss_fn=_loss_fn,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        process_group=None,
        rank=0,
        fresh_ddp=lambda: DDP(_model()),
    )


def _teardown(namespace: dict[str, Any]) -> None:
    os.chdir(namespace["_cwd"])


pytest_collect_file = Sybil(
    parsers=[
        PythonCodeBlockParser(doctest_optionflags=ELLIPSIS | NORMALIZE_WHITESPACE),
        SkipParser(),
    ],
    patterns=["README.md", "docs/*.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()
