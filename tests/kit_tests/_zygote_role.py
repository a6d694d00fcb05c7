"""A zygote role for the zygote's own tests (``test_zygote.py``): nothing heavy to warm; a child
prints where it runs, then ends as its request says."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

WARM_MODULES = ("json",)


def become(request: dict[str, Any]) -> None:
    """Print this child's session, working directory and ``ROLE_VAR``; then exit, die or wait."""
    print(json.dumps({"sid": os.getsid(0), "pid": os.getpid(), "cwd": os.getcwd(), "var": os.environ.get("ROLE_VAR")}))
    how = request["how"]
    if how == "exit":
        os._exit(3)
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "sigint":  # KeyboardInterrupt where SIGINT is handled as usual; ignored, it sleeps on
        os.kill(os.getpid(), signal.SIGINT)
    time.sleep(120)
