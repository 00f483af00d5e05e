"""Every pair of features works or is refused clearly, and
``docs/compositions.md`` says which, as the runs found it.

``make test`` checks the committed table: every pair present, every refusal
naming both of its features. ``make test-slow`` runs every pair on 4 gloo
ranks (:mod:`_compositions`: replicas that must agree do, after every step,
bit for bit), a drawn sample of triples, and checks the committed table is
what the runs write (``ZEROFN_WRITE_COMPOSITIONS=1`` rewrites it)."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest
from _compositions import BEGIN, END, EXCLUSIVE, NAMES, names_both, pairs, run_pairs, table
from _draws import THOROUGH
from zerofn_torch.runtime.launch import run_local_world

PAGE = Path(__file__).resolve().parent.parent / "docs" / "compositions.md"


def committed_block() -> str:
    text = PAGE.read_text()
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def test_the_table_covers_every_pair_and_each_refusal_names_both_features() -> None:
    block = committed_block()
    rows = {
        m.group(1): [c.strip() for c in m.group(2).split("|")]
        for m in re.finditer(r"^\| `(\w+)` \|((?: [^|\n]* \|)+)$", block, re.M)
        if m.group(1) in NAMES and m.group(2).count("|") == len(NAMES)
    }
    assert sorted(rows) == sorted(NAMES)
    refusals = re.findall(r"^\d+\. (\w+) \+ (\w+): (.*)$", block, re.M)
    for i, a in enumerate(NAMES):
        for j, b in enumerate(NAMES):
            cell = rows[a][j]
            if a == b:
                assert cell == ""
            elif frozenset((a, b)) in EXCLUSIVE:
                assert cell == "-"
            else:
                assert cell == rows[b][i], f"{a} + {b}: the table is not symmetric"
                assert cell in ("ok", "=") or re.fullmatch(r"R\d+", cell), f"{a} + {b}: {cell!r}"
    cited = {cell for row in rows.values() for cell in row if cell.startswith("R")}
    assert cited == {f"R{i}" for i in range(1, len(refusals) + 1)}
    for a, b, text in refusals:
        assert names_both((a, b), text), f"the refusal of {a} + {b} names one feature only: {text}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_pair_works_or_is_refused_naming_both_and_the_table_says_so(
    tmp_path: Path,
) -> None:
    outcomes = run_local_world(run_pairs, 4, pairs(), str(tmp_path), timeout_s=120.0)[0]
    failed = {k: v for k, v in outcomes.items() if not (v == "works" or v.startswith("refused"))}
    assert not failed
    for key, outcome in outcomes.items():
        a, b = key.split("+")
        if outcome != "works":
            assert names_both((a, b), outcome), f"{key}: {outcome}"
    written = table(outcomes)
    if os.environ.get("ZEROFN_WRITE_COMPOSITIONS"):
        PAGE.write_text(PAGE.read_text().replace(committed_block(), written))
    assert committed_block() == written, (
        "docs/compositions.md is stale: rerun with ZEROFN_WRITE_COMPOSITIONS=1"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_drawn_sample_of_triples_works_or_is_refused(tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    draw = random.Random(seed)
    choices = [
        tuple(sorted(draw.sample(NAMES, 3), key=NAMES.index)) for _ in range(24 if THOROUGH else 8)
    ]
    choices = [c for c in choices if not any(e <= set(c) for e in EXCLUSIVE)]
    outcomes = run_local_world(run_pairs, 4, choices, str(tmp_path), timeout_s=120.0)[0]
    failed = {k: v for k, v in outcomes.items() if v.startswith("FAILS")}
    assert not failed, f"seed {seed}: {failed}"
