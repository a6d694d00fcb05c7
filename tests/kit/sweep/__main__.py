"""``python -m tests.kit.sweep``: the sweep's command (``tests.kit.sweep.run``)."""

import sys

from tests.kit.sweep.run import main

sys.exit(main())
