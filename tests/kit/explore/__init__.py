"""L4, the generalization explorer: configurations of the whole ``fully_shard`` API drawn at
random, each run on the warm cluster against what the API promises for it, and any failure shrunk
to a minimal configuration (Hypothesis draws and shrinks).

One concept per file:

- ``space``: the configuration (plain, JSON-serialisable dataclasses) and the Hypothesis
  strategies that draw it, from the features the implementation under test declares;
- ``grammar``: the model grammar, which builds the ``nn.Module`` a configuration describes;
- ``oracle``: on every rank, the configuration run against its reference (what the API promises:
  the kit's explicit data-parallel reference) and the invariants every configuration keeps,
  recorded as the kit's checks;
- ``pairs``: pairwise coverage, and the covering phase run before the random draws;
- ``gathers``: which sharded modules are unsharded at each moment, so what must be all-gathered;
- ``runner``: the driver side: run one configuration on the cluster, explore (draw, run, shrink,
  save), replay a saved failure, count what was drawn;
- ``__main__``: ``python -m tests.kit.explore``.
"""
