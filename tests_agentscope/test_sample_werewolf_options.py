"""samples/werewolf's ``run.py`` takes the trainer's options from the samples' shared parser,
as every sample's does (``tests/sample_options.py``; the werewolf sample needs
AgentScope, so its check runs here)."""

from __future__ import annotations

import sys

import pytest
import sample_options as options


@pytest.mark.timeout(300)
def test_the_werewolf_run_py_takes_the_trainers_options_from_the_shared_parser():
    defaults = {"--steps": "1", "--rules": "agentscope", "--lr": "1e-05", "--train": "village"}
    options.check_sample_options("werewolf", defaults, python=sys.executable)
