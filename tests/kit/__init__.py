"""The validation kit: plan cases, L4 and the sweep run on a warm ipyparallel cluster of torch ranks,
judged against single-device or DDP baselines. One subpackage per layer; imports run one way, up:

- ``runtime``: the cluster, the ranks' process groups, devices, hang diagnosis (imports nothing here);
- ``judging``: levels, tolerances, the implementation surface and adapters, instruments, references,
  checks, the case contract, verdicts (imports runtime);
- ``workloads``: shared models, data and training loops (imports runtime, judging);
- ``plan``: the plan's assertions per case and how a verdict is judged against them (imports judging);
- ``explore``: L4, the generalization explorer (imports runtime, judging, plan);
- ``front``: the notebooks' helpers, conformance, evidence and pages (imports all of the above);
- ``sweep``: the main job, ``python -m tests.kit.sweep`` (imports all of the above).

``tests.kit.notebook`` is ``tests.kit.front.notebook`` under the name the notebooks import.
The kit's own tests live in ``tests/kit_tests``.
"""
