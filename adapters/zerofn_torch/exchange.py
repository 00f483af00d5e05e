"""Moved to :mod:`zerofn.zero.exchange` (the core): packing shards into exchange
buffers and the exchange program. This module keeps the old import path of
the copy functions working."""

from zerofn.zero.exchange import pack, slot_view, unpack

__all__ = ["pack", "slot_view", "unpack"]
