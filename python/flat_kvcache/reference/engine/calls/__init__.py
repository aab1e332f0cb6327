"""The cache's calls: one mixin per concern, each adding methods on top of
:class:`~flat_kvcache.reference.engine.coordinator.Coordinator` (the grouping of the Rust core's
``engine/calls/``).

In the order they build on each other (no module imports one listed after it):

- ``tables``: ``BlockTables``, flat per-group block tables (SPEC 8, 10) for a batch of
  requests each class names its own way, refused without the ``flat`` build feature;
- ``page``: ``PageTables``, what both protocols share (releasing and reclaiming a
  request's pages, counting an acquire's pages), and ``PageApi``, the page-level protocol,
  whose requests are named by id: match, claim, acquire, register, reclaim, free, the dry runs,
  the step operations (SPEC 6 to 8) and the readers by id;
- ``rows``: ``Rows``, persistent block-table rows (row ``s`` is the request in slot ``s``);
- ``token``: ``TokenApi``, requests that own their tokens, named by slot
  (docs/requests-api.md);
- ``admission``: ``Admission``, admission accounting, ``admit`` and reserves (SPEC 9);
- ``stats`` and ``invariants``: ``Stats`` and ``Invariants``, metrics and the SPEC 1
  checks.

Nothing is re-exported here: ``engine/__init__.py`` imports each mixin from its module and
composes ``FlatKVCache`` and ``PageCache`` from them.
"""
