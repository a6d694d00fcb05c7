"""torch's own FSDP2 test suite as a judge of any implementation the kit knows.

The test files are read at run time from a folder the user gives (a sparse checkout of pytorch, or
files read at chosen commits): nothing of them is kept here. ``swap`` replaces torch FSDP2's public
names by the implementation's before the tests import them, ``harness`` (a pytest plugin) bounds
every test and records its outcome, ``classify`` sorts each failure, ``report`` writes the page.
``python -m tools.peer_suite --help``.
"""
