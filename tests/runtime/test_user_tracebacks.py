"""A rollout that raises in worker processes points at the user's script: its traceback (printed
and stored) names the script's file and the raising line, as it would in one process."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

SCRIPT = """\
import voltrl as vl


def agent(task, resources):
    raise ValueError(f"bad question {{task['q']}}")


class Agent(vl.LitAgent):
    def rollout(self, task, resources):
        return 1 / 0


trainer = vl.Trainer(run_dir="runs", name="{name}", progress=False, n_runners=1)
try:
    trainer.dev({agent}, [{{"q": 1}}])
except vl.VoltRLError as exc:
    print("stopped:", exc)
"""


def _traceback_stored(run_dir) -> str:
    """The traceback of the only attempt of the only rollout in ``run_dir``'s store."""
    from voltrl.store.sql import SQLStore

    async def read() -> str:
        store = SQLStore(run_dir / "store.sqlite")
        try:
            [rollout] = await store.query_rollouts()
            [attempt] = await store.get_attempts(rollout.rollout_id)
            return attempt.traceback or ""
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("agent", "line", "code"),
    [
        ("agent", 5, "raise ValueError"),
        ("Agent()", 10, "return 1 / 0"),
    ],
)
def test_a_rollout_raising_in_a_worker_process_names_the_script_and_line(
    tmp_path, agent, line, code
):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(name="tb", agent=agent))
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert "stopped: the run stopped" in out.stdout, out.stdout + out.stderr
    where = f'File "{script}", line {line}'
    assert "<dynamic-code>" not in out.stdout + out.stderr
    assert where in out.stdout, out.stdout  # the first occurrence, printed
    assert code in out.stdout.split(where, 1)[1].splitlines()[1]  # with its source line
    stored = _traceback_stored(tmp_path / "runs" / "tb")
    assert where in stored and code in stored.split(where, 1)[1].splitlines()[1], stored
