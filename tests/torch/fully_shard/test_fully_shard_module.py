"""pytest entry points of the cases in ``_test_fully_shard_module.py`` (test names are the plan's)."""

from tests.kit.front.pytest_cases import export_cases

export_cases(globals(), "tests.torch.fully_shard._test_fully_shard_module")
