"""Mutation harness of the engine: realistic bugs applied one at a time to a scratch copy of the
repository, the plan cases and the engine tests run against each, a kill matrix as evidence.

``python -m tools.mutants --help`` (or ``make mutants``); see ``tools/mutants/README.md``.
Kept free of heavy imports: ``tools.mutants.pytest_progress`` is loaded into every pytest run.
"""
