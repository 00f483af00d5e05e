"""Shared fixtures: a one-rank gloo group inside the pytest process, for tests
of the adapter's single-rank behaviour and its input checks; and hypothesis's
default draw count for tests that state none (see ``_draws``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from _draws import draws
from hypothesis import settings

settings.register_profile("zerofn", max_examples=draws(100))
settings.load_profile("zerofn")


@pytest.fixture(scope="session")
def single_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()
