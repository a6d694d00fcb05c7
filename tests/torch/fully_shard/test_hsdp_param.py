"""pytest entry points of the cases in ``_test_hsdp_param.py`` (test names are the plan's)."""

from tests.kit.front.pytest_cases import export_cases

export_cases(globals(), "tests.torch.fully_shard._test_hsdp_param")
