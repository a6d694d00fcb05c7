"""The kit's runtime, its bottom layer: the warm ipyparallel cluster of torch ranks (``cluster``,
``engines``), what runs on each rank around a case (``rank_runtime``: process groups, threads,
bounded waits), the device choice (``devices``), the stacks of a hung or dead rank
(``diagnosis``, ``_watchdog``).

Imports no other part of the kit: it runs any function on the ranks and knows nothing of cases.
"""
