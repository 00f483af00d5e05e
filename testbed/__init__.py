"""The repository's network testbed, for benchmarks and multi-node tests: links
shaped to a rate (and a WAN's delay) between network namespaces on one
machine (:mod:`testbed.links`, built from :mod:`testbed.shaping`,
:mod:`testbed.namespaces` and :mod:`testbed.delay_line`). It is not part of
the library and is not installed with it; it imports from the repository's
root. See ``docs/links.md``."""
