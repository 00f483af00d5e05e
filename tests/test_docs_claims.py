"""What the pages say the code does, checked against the code.

The pages' own examples run as tests already (Sybil, see the repository's
``conftest.py``); this file checks what an example cannot show. Each entry of
:data:`REFUSALS` pairs a sentence of a page that names a refusal with a call
that must make it: the test fails when the page no longer says it (the entry
is stale) or when the code no longer refuses (the page is wrong).
:data:`ACCEPTED` does the same for things a page says work. Pages are matched
with their whitespace folded, so a phrase may cross a line break. All of it
runs on one in-process gloo rank, in milliseconds.

It also checks that the design page's tree names every module there is, and
that the site's navigation lists every page.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from zerofn_torch import ZeroRedundancyOptimizer
from zerofn_torch.averaging import (
    HierarchicalModelAverager,
    PeriodicModelAverager,
    PostLocalSGDOptimizer,
)
from zerofn_torch.checkpoint import save_sharded
from zerofn_torch.hooks import PowerSGDState
from zerofn_torch.join import Join

from zerofn.blockquant import BlockQuantizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def page_text(page: str) -> str:
    """The page at ``page`` (from the repository root), whitespace folded."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return " ".join(f.read().split())


def params(n: int = 2, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(4, 3, dtype=dtype)) for _ in range(n)]


def zero(*args: Any, optimizer: Any = torch.optim.Adam, **kwargs: Any) -> ZeroRedundancyOptimizer:
    """A ZeRO optimizer over ``args[0]`` (fresh parameters if none), lr 0.1."""
    kwargs.setdefault("lr", 0.1)
    return ZeroRedundancyOptimizer(args[0] if args else params(), optimizer, **kwargs)


def stepped_zero() -> ZeroRedundancyOptimizer:
    """:func:`zero` after one step: it holds state now."""
    opt = zero()
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    return opt


def leave_out_a_trainable_parameter() -> None:
    p = params()
    zero(p, partition=[[p[0]]])


def flat_after_a_change_in_requires_grad() -> None:
    p = params()
    opt = zero(p, optimizer=torch.optim.SGD, partition="flat")
    for q in p:
        q.grad = torch.ones_like(q)
    opt.step()
    p[0].requires_grad_(False)
    opt.step()


def step_with_a_closure_and_masters() -> None:
    p = params(dtype=torch.bfloat16)
    opt = zero(p, master_dtype=torch.float32)
    for q in p:
        q.grad = torch.ones_like(q)
    opt.step(closure=lambda: 0.0)


def join_two_groups() -> None:
    other = dist.new_group([0])
    with Join([zero(), zero(process_group=other)]):
        pass


def non_increasing_periods() -> None:
    HierarchicalModelAverager(collections.OrderedDict([(4, 1), (2, 1)]), warmup_steps=0)


def save_over_a_directory_of_other_files() -> None:
    target = tempfile.mkdtemp(prefix="zerofn-claims-")
    with open(os.path.join(target, "model.pt"), "w") as f:
        f.write("not a checkpoint")
    try:
        save_sharded(zero(), target)
    finally:
        # Refused before anything was written: the directory is as it was.
        assert os.listdir(target) == ["model.pt"]
        shutil.rmtree(target)


def load_a_negative_averaging_step() -> None:
    model = torch.nn.Linear(3, 2)
    averager = PeriodicModelAverager(period=2, warmup_steps=0)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)
    state = opt.state_dict()
    state["step"] = -1
    opt.load_state_dict(state)


REFUSALS: list[tuple[str, str, Callable[[], object], type[Exception], str]] = [
    # (page, what it says, a call it says is refused, the exception, its message)
    (
        "docs/compressed_exchange.md",
        'an unknown name (`ValueError` listing `"int8"`, `"int4"`)',
        lambda: zero(exchange_compression="int2"),
        ValueError,
        "int4.*int8",
    ),
    (
        "docs/compressed_exchange.md",
        "non-floating-point parameters (`ValueError`)",
        lambda: zero([torch.zeros(4, dtype=torch.int32)], exchange_compression="int8"),
        ValueError,
        "floating-point",
    ),
    (
        "docs/compressed_exchange.md",
        "an int4 quantizer with an odd block (`ValueError`)",
        lambda: zero(exchange_compression=BlockQuantizer(4, 127)),
        ValueError,
        "even",
    ),
    (
        "docs/compressed_exchange.md",
        "something that is neither a name nor a `BlockQuantizer` (`TypeError`)",
        lambda: zero(exchange_compression=8),
        TypeError,
        "BlockQuantizer",
    ),
    (
        "docs/zero.md",
        "(`lr=-1` is a `ValueError`",
        lambda: zero(lr=-1),
        ValueError,
        "learning rate",
    ),
    (
        "docs/zero.md",
        "an unknown name a `TypeError`)",
        lambda: zero(bogus=1),
        TypeError,
        "bogus",
    ),
    (
        "docs/zero.md",
        "leaving out a trainable one raises `ValueError` naming its global index",
        leave_out_a_trainable_parameter,
        ValueError,
        "global index 1",
    ),
    (
        "docs/partition.md",
        "it refuses a manual partition that gives a trainable parameter no",
        leave_out_a_trainable_parameter,
        ValueError,
        "no rank",
    ),
    (
        "docs/zero.md",
        'Under `"flat"` this raises `ValueError`',
        flat_after_a_change_in_requires_grad,
        ValueError,
        "require grad",
    ),
    (
        "docs/zero.md",
        "`ValueError` for empty, sparse or mixed-dtype parameters",
        lambda: zero([]),
        ValueError,
        "empty",
    ),
    (
        "docs/zero.md",
        "`ValueError` for empty, sparse or mixed-dtype parameters",
        lambda: zero([torch.zeros(4, 3).to_sparse()]),
        ValueError,
        "dense",
    ),
    (
        "docs/zero.md",
        "`ValueError` for empty, sparse or mixed-dtype parameters",
        lambda: zero([torch.zeros(3), torch.zeros(3, dtype=torch.float64)]),
        ValueError,
        "dtype",
    ),
    (
        "docs/zero.md",
        "`TypeError` for a tensor, a non-iterable or a mix of tensors and dicts",
        lambda: zero(torch.zeros(3)),
        TypeError,
        "single",
    ),
    (
        "docs/zero.md",
        "`TypeError` for a tensor, a non-iterable or a mix of tensors and dicts",
        lambda: zero(3),
        TypeError,
        "iterable",
    ),
    (
        "docs/zero.md",
        "`TypeError` for a tensor, a non-iterable or a mix of tensors and dicts",
        lambda: zero([torch.zeros(3), {"params": [torch.zeros(2)]}]),
        TypeError,
        "mix",
    ),
    (
        "docs/zero.md",
        "`RuntimeError` for `state_dict()` once stepped, before",
        lambda: stepped_zero().state_dict(),
        RuntimeError,
        "consolidate",
    ),
    (
        "docs/checkpoints.md",
        "or before consolidating, it raises `RuntimeError`",
        lambda: stepped_zero().state_dict(),
        RuntimeError,
        "consolidate",
    ),
    (
        "docs/zero.md",
        "Any other class is refused with a `ValueError` naming it",
        lambda: zero(optimizer=torch.optim.LBFGS, partition="flat"),
        ValueError,
        "LBFGS",
    ),
    (
        "docs/zero.md",
        "`step()` then does nothing, and raises `RuntimeError` if no such hook was made",
        lambda: zero(overlap_with_ddp=True).step(),
        RuntimeError,
        "hook",
    ),
    (
        "docs/overlap.md",
        "`zero.clip_grad_norm_` raises in this mode",
        lambda: zero(overlap_with_ddp=True).clip_grad_norm_(1.0),
        RuntimeError,
        "overlap_with_ddp",
    ),
    (
        "docs/mixed_precision.md",
        "`step(closure)` is refused with `master_dtype`",
        step_with_a_closure_and_masters,
        ValueError,
        "closure",
    ),
    (
        "docs/join.md",
        "Joinables on different process groups are refused with `ValueError`",
        join_two_groups,
        ValueError,
        "process group",
    ),
    (
        "docs/powersgd.md",
        "Bad configuration raises at construction: `matrix_approximation_rank < 1`",
        lambda: PowerSGDState(None, matrix_approximation_rank=0),
        ValueError,
        "matrix_approximation_rank",
    ),
    (
        "docs/averaging.md",
        "`HierarchicalModelAverager` refuses periods that are not strictly increasing",
        non_increasing_periods,
        ValueError,
        "strictly increasing",
    ),
    (
        "docs/averaging.md",
        "a negative or non-integer step raises before anything is loaded",
        load_a_negative_averaging_step,
        ValueError,
        "non-negative",
    ),
    (
        "docs/checkpoints.md",
        "refused with `ValueError` before anything is written",
        save_over_a_directory_of_other_files,
        ValueError,
        "model.pt",
    ),
]

ACCEPTED: list[tuple[str, str, Callable[[], object]]] = [
    # (page, what it says, a call it says works)
    (
        "docs/compressed_exchange.md",
        "`overlap_with_ddp=True` (with [`hook_with_zero_step`](overlap.md)) compresses alike",
        lambda: zero(overlap_with_ddp=True, exchange_compression="int8"),
    ),
]


def _id(entry: tuple[Any, ...]) -> str:
    return f"{os.path.basename(entry[0])}: {entry[1][:50]}"


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("entry", REFUSALS, ids=[_id(e) for e in REFUSALS])
def test_a_refusal_a_page_names_is_made(
    entry: tuple[str, str, Callable[[], object], type[Exception], str],
) -> None:
    page, phrase, call, error, message = entry
    assert " ".join(phrase.split()) in page_text(page), f"{page} no longer says {phrase!r}"
    with pytest.raises(error, match=message):
        call()


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("entry", ACCEPTED, ids=[_id(e) for e in ACCEPTED])
def test_what_a_page_says_works_is_accepted(entry: tuple[str, str, Callable[[], object]]) -> None:
    page, phrase, call = entry
    assert " ".join(phrase.split()) in page_text(page), f"{page} no longer says {phrase!r}"
    call()


def _modules(package: str) -> set[str]:
    """The module names (file stems) under ``package``, ``__init__`` aside."""
    found = set()
    for _, _, files in os.walk(os.path.join(ROOT, package)):
        found |= {f[:-3] for f in files if f.endswith(".py") and f != "__init__.py"}
    return found


def test_the_design_pages_tree_names_every_module() -> None:
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        text = f.read()
    tree = text.split("## What lives where", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", tree))
    missing = (_modules("zerofn") | _modules("adapters/zerofn_torch")) - named
    assert not missing, f"docs/design.md's tree does not name {sorted(missing)}"


def test_the_sites_navigation_lists_every_page() -> None:
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = set(re.findall(r"^\s+- (?:[^\n]*?: )?(\S+\.md)\s*$", f.read(), re.MULTILINE))
    docs = os.path.join(ROOT, "docs")
    pages = {
        os.path.relpath(os.path.join(folder, f), docs).replace(os.sep, "/")
        for folder, _, files in os.walk(docs)
        for f in files
        if f.endswith(".md")
    }
    assert pages <= nav, f"mkdocs.yml's nav does not list {sorted(pages - nav)}"
