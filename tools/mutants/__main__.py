"""``python -m tools.mutants``: see ``tools/mutants/README.md`` or ``--help``."""

from .cli import main

raise SystemExit(main())
