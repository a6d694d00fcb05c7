"""Moved to ``tests/kit/front/notebook.py``: the notebooks import it by this name."""

from tests.kit.front.notebook import *  # noqa: F403
