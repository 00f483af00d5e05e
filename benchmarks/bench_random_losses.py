"""Faults at random moments, many of them: ``examples/random_losses.py``'s
soak on 3, 4 and 8 gloo ranks in each configuration of ``train_elastic.CONFIGS``
(over a hundred runs, a rank ended or paused at a random moment in each),
every run checked for consistency and the first loss of each world size and
configuration bit for bit against a reference. It reports the runs, the
losses, the pauses, the transient recoveries and the seconds a run took; any
inconsistent run fails the benchmark, naming its seed. ``--quick``: two runs
per configuration on 3 ranks."""

from __future__ import annotations

import itertools
import os
import sys

from report import Headline, Section, Spread, md_table, standalone_main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
from random_losses import GROUP_TIMEOUT_S, STEPS, soak
from train_elastic import CONFIGS, legend

WORLDS = {3: 24, 4: 24, 8: 12}
"""Runs per world size and configuration in a full run."""


def bench_random_losses(quick: bool) -> Section:
    worlds = {3: 2} if quick else WORLDS
    rows, total = [], {"runs": 0, "losses": 0, "pauses": 0, "transient": 0}
    for (world_size, runs), config in itertools.product(worlds.items(), CONFIGS.values()):
        seed = int.from_bytes(os.urandom(4), "little")
        result = soak(world_size, runs, seed, verbose=True, config=config)
        for key in total:
            total[key] += result[key]
        spread = Spread.of(result["seconds"])
        rows.append(
            [
                world_size,
                config.name,
                result["runs"],
                result["losses"],
                result["pauses"],
                result["transient"],
                result["referenced"],
                f"{spread.median:.1f} [{spread.q1:.1f}, {spread.q3:.1f}]",
                seed,
            ]
        )
    body = (
        f"DDP + `ZeroRedundancyOptimizer(Adam, redundancy=2)`, {STEPS} steps a run, in each "
        f"configuration ({legend()}); in each run "
        "one rank drawn at random is ended (`os._exit`) or, one run in four, paused (`SIGSTOP`, "
        "0.5 to 12 s) from a timer thread after a random delay within the run, wherever its "
        "main thread is. Every run is checked with no reference (every step completed once, "
        "one Adam step count, identical parameters, one agreed point per recovery, no survivor "
        f"waiting for the faulted worlds' {GROUP_TIMEOUT_S:.0f} s collective timeout, a paused "
        "rank either going on or failing alone); the first loss of each world size also bit for "
        "bit against a run that shrank at the same step. Inconsistent runs: **0** (any would "
        "have failed this benchmark).\n\n"
        + md_table(
            [
                "ranks",
                "configuration",
                "runs",
                "ranks lost",
                "paused",
                "transient recoveries",
                "checked against a reference",
                "seconds a run, median [q1, q3]",
                "seed",
            ],
            rows,
        )
    )
    headline = Headline(
        "random-moment faults, 3/4/8 gloo ranks",
        "inconsistent runs, of runs with a fault",
        Spread.exact(0.0),
        target="= 0",
        met=True,
        short="inconsistent runs",
    )
    return Section("Faults at random moments (gloo, CPU)", body, (headline,))


BENCHES = {"random-losses": bench_random_losses}

if __name__ == "__main__":
    standalone_main(BENCHES, __doc__)
