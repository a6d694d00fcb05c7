"""Adapters of the implementation surface (``tests.kit.judging.surface``): one module per kind of
implementation, each with ``load(spec) -> Implementation``. They only translate."""
