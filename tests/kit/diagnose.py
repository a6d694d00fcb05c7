"""``python -m tests.kit.diagnose CASE_ID [--implementation SPEC] [--json PATH]``: where a case went
wrong (``tests.kit.front.diagnose``)."""

import sys

from tests.kit.front.diagnose import main

if __name__ == "__main__":
    sys.exit(main())
