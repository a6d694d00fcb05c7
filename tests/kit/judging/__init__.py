"""How the kit judges: the plan's levels and its precision matrix (``levels``, ``tolerances``), the
implementation seen only through its API (``surface`` and its ``adapters``), the instruments
(``recorder``: collectives, ``memory``, ``layout``, ``determinism``), the references
(``reference``), the checks a case records and the case contract (``checks``, ``case_spec``,
``case``), and the verdicts (``verdict``, ``verdict_store``).

May import ``tests.kit.runtime`` only.
"""
