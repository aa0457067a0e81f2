"""``voltrl teacher serve`` as a user runs it: a process, and the lines it printed up to
"Ctrl-C stops it" (what the teacher server's and the docs recipe's tests start)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path


class TeacherServe:
    """A ``voltrl teacher serve`` process and the lines it printed up to "Ctrl-C stops it"."""

    def __init__(self, *args: str, cwd: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "VOLTRL_TOKEN"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "voltrl.cli", "teacher", "serve", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        self.lines: list[str] = []
        while not self.lines or not self.lines[-1].startswith("Ctrl-C"):
            line = lines.get(timeout=60)
            if line is None:
                raise AssertionError(f"the server exited: {self.proc.wait()}")
            self.lines.append(line.rstrip("\n"))
        self.endpoint = re.findall(r" at (http://\S+/v1) ", "\n".join(self.lines))[0]

    def _read(self, lines: queue.Queue[str | None]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.put(line)
        lines.put(None)

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(30)
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read()
