"""The defects harness: the kit judged on the bugs upstream HyperParallel's history fixed
(``python -m tools.defects``; see ``__main__`` and ``catalogue``)."""
