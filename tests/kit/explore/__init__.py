"""L4, the generalization explorer: configurations of the whole ``fully_shard`` API drawn at
random, each run on the warm cluster against what the API promises for it, and any failure shrunk
to a minimal configuration (Hypothesis draws and shrinks).

One concept per file:

- ``space``: the configuration (plain, JSON-serialisable dataclasses);
- ``draws``: the Hypothesis strategies that draw it, from the features the implementation under
  test declares;
- ``grammar``: the model grammar, which builds the ``nn.Module`` a configuration describes;
- ``promised``: the reference, what the API promises (the kit's explicit data-parallel reference
  generalised to per-param groups and ops);
- ``oracle``: on every rank, the configuration set up and stepped beside its reference;
  ``invariants`` (at fixed points of a step) and ``timing`` (through module hooks: prefetch timing,
  freed storage) check what every configuration keeps, recorded as the kit's checks;
- ``gathers``: which sharded modules are unsharded at each moment, so what must be all-gathered;
- ``storages``: weak references to the storage a module's params used while unsharded;
- ``pairs``: pairwise coverage, and the covering phase run before the random draws;
- ``runner``: the driver side: run one configuration on the cluster, explore (draw, run, shrink,
  save), replay a saved failure, count what was drawn; ``survey``: keep going past failures;
- ``report``: the L4 notebook's cells; ``__main__``: ``python -m tests.kit.explore``.

May import ``tests.kit.runtime``, ``tests.kit.judging`` and ``tests.kit.plan``.
"""
