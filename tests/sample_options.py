"""What every sample's run.py must take from the samples' shared parser (samples/sample_cli.py),
checked by running it: the samples' tests and the werewolf sample's (tests_agentscope/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import SAMPLES

DRIVER = """
import contextlib, io, json, runpy, sys
main = runpy.run_path(sys.argv[1], run_name="sample")["main"]
out = {}
for name, argv in [("dev", ["dev", "--help"]), ("train", ["train", "--help"]),
                   ("loggers", ["train", "--loggers", "tensorboard,nope"]),
                   ("resume", ["train", "--resume"])]:
    text, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            out[name] = [exc.code, text.getvalue(), err.getvalue()]
print(json.dumps(out))
"""
"""Runs a sample's ``main`` on each command line in one process (a sample's framework is
imported once); prints each one's exit status, stdout and stderr as JSON."""


def sample_options(sample: str, python: str = sys.executable) -> dict[str, list]:
    """What :data:`DRIVER` printed for ``samples/<sample>/run.py``."""
    out = subprocess.run(
        [python, "-c", DRIVER, str(SAMPLES / sample / "run.py")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def option_helps(text: str) -> dict[str, str]:
    """Each option of a ``--help`` text and its entry (the option, its help), on one line."""
    entries: dict[str, str] = {}
    option = None
    for line in text.splitlines():
        if line.startswith("  -"):
            option = line.split()[0].rstrip(",")
            entries[option] = line.strip()
        elif option is not None and line.startswith("   "):
            entries[option] += " " + line.strip()
        else:
            option = None
    return entries


def check_sample_options(
    sample: str, train_defaults: dict[str, str], python: str = sys.executable
) -> None:
    """The assertions every sample's ``run.py`` passes (the werewolf sample's run in
    AgentScope's environment, ``tests_agentscope/``): the shared options, the defaults of
    ``train``'s options ``train_defaults`` shown at the end of their help, and no empty
    default (``None``, ``False``, ``[]``) shown at all."""
    out = sample_options(sample, python)
    helps: dict[str, dict[str, str]] = {}  # per command, each option's help line
    for command in ("dev", "train"):
        status, text, _ = out[command]
        assert status == 0, (command, text)
        lines = helps[command] = option_helps(text)
        assert {"--run-dir", "--name", "--loggers"} <= set(lines), (command, list(lines))
        assert lines["--run-dir"].startswith("--run-dir DIR, --out DIR ")
        assert lines["--run-dir"].endswith("directory of run directories (default: runs)")
        assert "comma-separated: tensorboard, wandb, mlflow" in lines["--loggers"]
        assert ("--resume" in lines) == (command == "train")
        assert not [d for d in ("None)", "[])", "False)") if f"(default: {d}" in text]
    for option, default in train_defaults.items():
        assert helps["train"][option].endswith(f"(default: {default})"), helps["train"][option]
    status, _, err = out["loggers"]
    assert status == 2 and "argument --loggers: unknown logger 'nope'" in err
    status, _, err = out["resume"]
    assert status == 2 and "--resume needs the --name of the run to continue" in err
