"""pytest entry points of the cases in ``_test_fully_shard_fsdp2_roots.py`` (test names are the cases' own)."""

from tests.kit.front.pytest_cases import export_cases

export_cases(globals(), "tests.torch.fully_shard._test_fully_shard_fsdp2_roots")
