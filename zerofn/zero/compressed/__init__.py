"""The compressed exchange (``exchange_compression``): quantized shard
differences that keep every replica identical
(:mod:`~zerofn.zero.compressed.exchange`), where each piece of a payload lies
(:mod:`~zerofn.zero.compressed.payloads`), and an exchange a lost rank cut
short, finished (:mod:`~zerofn.zero.compressed.finish`)."""
