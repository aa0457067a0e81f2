"""A sample's scripted teacher, served OpenAI-compatible by VoltRL's teacher server
(:mod:`voltrl.serving.teacher`, ``voltrl teacher serve``) the way a hosted API answers (no
token ids).

The framework samples' CPU learning recipes (``samples/recipe_runner.py``, ``make learn``)
record a teacher's rollouts through the real framework and gateway with it, then warm-start a
tiny student on them (:class:`voltrl.SFT`) before RL. A sample's ``teacher.py`` defines the
policy over the whole request body::

    def teacher_reply(request: dict, rng: random.Random) -> dict:
        '''The assistant message ({"content": ...} or {"tool_calls": [...]}) for a request.'''

:func:`sample_policy` makes it a teacher server's policy (which gets ``request`` and ``rng`` by
naming them). ``rng`` is seeded by the teacher's seed and the request's first user message, so
every call of one episode draws the same numbers (a teacher that decides to make a mistake on a
task makes it consistently) and a re-run records the same rollouts.

Standalone, to try a sample's ``dev`` against it::

    python samples/teacher_server.py autogen_calc --port 8011 &
    python samples/autogen_calc/run.py dev --endpoint http://127.0.0.1:8011/v1 \\
        --model teacher --no-token-ids --n 50
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from voltrl.errors import VoltRLError
from voltrl.serving.teacher import Policy, load_policy
from voltrl.serving.teacher import serve_teacher as serve_policy

SampleTeacher = Callable[[dict[str, Any], random.Random], dict[str, Any]]
"""A sample's ``teacher_reply``: a chat-completions request body and its rng → the message."""

HERE = Path(__file__).resolve().parent


def sample_policy(teacher_reply: SampleTeacher) -> Policy:
    """The teacher server's policy of a sample's ``teacher_reply(request, rng)``."""

    def policy(messages: list[Any], tools: list[Any], *, request: dict, rng: random.Random):
        return teacher_reply(request, rng)

    policy.__qualname__ = getattr(teacher_reply, "__qualname__", "teacher_reply")
    return policy


def load_sample_teacher(sample: str) -> Policy:
    """The policy of ``samples/<sample>/teacher.py`` (its ``teacher_reply``)."""
    path = HERE / sample / "teacher.py"
    if not path.exists():
        raise SystemExit(f"no teacher for {sample!r}: {path} does not exist")
    if str(HERE) not in sys.path:  # teachers share modules of this directory
        sys.path.insert(0, str(HERE))
    return sample_policy(load_policy(f"{path}:teacher_reply"))


@contextmanager
def serve_teacher(teacher_reply: SampleTeacher, *, seed: int = 0) -> Iterator[str]:
    """Serve a sample's ``teacher_reply`` on loopback (a thread of its own) and yield its
    ``.../v1`` URL."""
    with serve_policy(sample_policy(teacher_reply), seed=seed) as url:
        yield url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sample", help="a sample directory with a teacher.py (autogen_calc...)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from voltrl._http.serving import run, serve_in_thread, wait_for_signal
    from voltrl.serving.teacher import teacher_app

    try:
        app = teacher_app(load_sample_teacher(args.sample), seed=args.seed)
    except VoltRLError as exc:
        raise SystemExit(str(exc)) from None
    with serve_in_thread(app, port=args.port) as server:
        print(f"teacher of {args.sample} at {server.url}/v1", flush=True)
        run(wait_for_signal())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
