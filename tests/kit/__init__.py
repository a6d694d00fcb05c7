"""Validation kit helpers: the warm ipyparallel cluster of torch ranks (``tests.kit.cluster``)."""
