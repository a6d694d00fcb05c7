"""pytest entry points of the plan's ``test_fully_shard_module.py`` (test names are the plan's): its
cases by level in ``_test_fully_shard_module_l0.py``, ``_test_fully_shard_module.py`` (L1) and
``_test_fully_shard_module_list.py`` (L1-09)."""

from tests.kit.front.pytest_cases import export_cases

export_cases(
    globals(),
    "tests.torch.fully_shard._test_fully_shard_module_l0",
    "tests.torch.fully_shard._test_fully_shard_module",
    "tests.torch.fully_shard._test_fully_shard_module_list",
)
