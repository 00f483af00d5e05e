"""How many examples a property test draws.

Each test states the count it deserves when time is no object; ``make test``
(run many times a day) draws a quarter of it, at least ten, and ``make
test-slow`` (``ZEROFN_DRAWS=thorough``, run by CI) draws it all. The quick
draws still reach every strategy's corner cases: hypothesis tries the
smallest and the boundary values first, and its example database replays
every failure it has seen on this machine.
"""

from __future__ import annotations

import os

THOROUGH = os.environ.get("ZEROFN_DRAWS", "quick") == "thorough"


def draws(thorough: int) -> int:
    """The examples to draw for a test that deserves ``thorough`` of them."""
    return thorough if THOROUGH else min(thorough, max(10, thorough // 4))
