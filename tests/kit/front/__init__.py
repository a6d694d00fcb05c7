"""The front ends people use: the level notebooks' helpers (``notebook``), the plan-fidelity page
(``plan_page``), pytest's view of the cases (``pytest_cases``), the conformance of other
implementations (``conformance``), and the evidence (``evidence``: kernels, provenance, pages).

May import every layer below it: runtime, judging, workloads, plan, explore. The sweep
(``tests.kit.sweep``) sits above it.
"""
