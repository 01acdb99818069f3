"""Every test and fixture of the kit in one module, for a backend package's own suite: its
``tests/test_conformance.py`` star-imports this, and its pytest addopts give ``--fd-device``
(what ``fd backend new`` generates)."""

from fd_core.conformance.test_collectives import *  # noqa: F401,F403
from fd_core.conformance.test_contract import *  # noqa: F401,F403
from fd_core.conformance.test_generation import *  # noqa: F401,F403
from fd_core.conformance.test_memory import *  # noqa: F401,F403
from fd_core.conformance.test_ops import *  # noqa: F401,F403
