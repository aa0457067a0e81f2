"""The AgentScope adapter's tests run in AgentScope's own environment (``.venv-agentscope``,
see constraints/agentscope.txt) and share the scripted backend and helpers of ``tests/``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# AgentScope logs to stderr at INFO from its own logger; tests want warnings only.
logging.getLogger("as").setLevel(logging.WARNING)
