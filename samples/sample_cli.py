"""What the ``run.py`` scripts of the samples share: one help format, the trainer's options
(``--run-dir``, ``--name``, ``--loggers``, ``--resume``), the ``dev`` and ``train`` options, the
held-out split, a ``dev`` run against an endpoint and a LocalRL ``train`` run on this machine.

A sample's ``run.py`` puts this directory on ``sys.path`` and imports it by name. Its ``train``
passes LocalRL a model *name* (``--model``, else ``tiny``), so the run's ``train.yaml`` runs it
again: ``voltrl train runs/<name>/train.yaml``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import voltrl as vl
from voltrl.cli.options import add_loggers_arg

MakeRows = Callable[..., list[dict[str, Any]]]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every sample's ``--help``: each option's help ends with its default, when it has one
    (not for a flag, a required option, or one whose default is None or empty: its help says
    what leaving it out means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        none = default is None or default is False or default == [] or default is argparse.SUPPRESS
        if action.required or none:
            return action.help
        return super()._get_help_string(action)


def sample_parser(doc: str) -> tuple[argparse.ArgumentParser, Any]:
    """A sample's parser (described by ``doc``'s first line) and its subcommands."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0], formatter_class=HelpFormatter)
    return parser, parser.add_subparsers(dest="command", required=True)


def subcommand(
    sub: Any, name: str, help: str, parents: Sequence[argparse.ArgumentParser] = ()
) -> argparse.ArgumentParser:
    """Subcommand ``name`` of a sample's parser, with the samples' help format."""
    return sub.add_parser(
        name, parents=list(parents), help=help, description=help, formatter_class=HelpFormatter
    )


def trainer_options() -> argparse.ArgumentParser:
    """The trainer's options every sample's ``dev`` and ``train`` take (a parent parser):
    ``--run-dir`` (or ``--out``), ``--name`` and ``--loggers`` (as ``voltrl train`` takes it)."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--run-dir",
        "--out",
        dest="run_dir",
        metavar="DIR",
        type=Path,
        default=Path("runs"),
        help="directory of run directories",
    )
    options.add_argument(
        "--name", default=None, help="run name (default: the sample's, or a fresh one)"
    )
    add_loggers_arg(options)
    return options


def add_resume(train: argparse.ArgumentParser) -> None:
    """``--resume``: continue run ``--name`` from its checkpoint (see :func:`check_resume`)."""
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue run --name from its last checkpoint, with the same options (more "
        "--steps may be given; a changed option that alters the data or the model is refused)",
    )


def check_resume(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error when ``--resume`` comes without the ``--name`` of the run."""
    if getattr(args, "resume", False) and not args.name:
        parser.error("--resume needs the --name of the run to continue")


def trainer_args(args: argparse.Namespace, default_name: str | None = None) -> dict[str, Any]:
    """``vl.Trainer``'s ``run_dir``, ``name`` and ``loggers`` from the trainer options."""
    return {"run_dir": args.run_dir, "name": args.name or default_name, "loggers": args.loggers}


def run_name(args: argparse.Namespace, default: str) -> str:
    """The name the run will get (``--name``, else ``default``), known before it starts so the
    agent's side files go into its directory: a name whose directory holds another run that
    this one does not resume becomes ``NAME-2``... (said on the console)."""
    from voltrl.runtime.run_dir import run_name as trainer_run_name

    resume = getattr(args, "resume", False)
    return trainer_run_name(args.run_dir, args.name or default, args.command, resume)


def main_with(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    run: Callable[[argparse.Namespace], int],
    *,
    errors: tuple[type[Exception], ...] = (),
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
) -> int:
    """Parse ``argv``, ``check`` the options (it calls ``parser.error`` for a bad mix) and
    ``run`` the command; returns its exit status. A VoltRL error (or one of ``errors``) is one
    line on stderr and status 1; Ctrl-C during ``train`` prints the command that resumes the
    run (status 130)."""
    args = parser.parse_args(argv)
    check_resume(parser, args)
    if check is not None:
        check(parser, args)
    try:
        return run(args)
    except (vl.VoltRLError, *errors) as exc:
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.command == "train":
            name = args.name or "<the run's name, above>"
            print(f"resume with: run.py train --name {name} --resume (and the same options)")
        return 130


def run_command(args: argparse.Namespace) -> int:
    """Run the ``dev`` or ``train`` that :func:`add_commands` parsed: 0, or 1 when some
    rollouts failed."""
    result = args.run(args)
    return 0 if result.stats.failed == 0 else 1


def held_out_split(
    make: MakeRows, seed: int, n_train: int, n_val: int
) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows of ``make(n, seed=...)``, no question in both."""
    val = make(n_val, seed=10_000 + seed)
    held_out = {row["question"] for row in val}
    train = [r for r in make(n_train, seed=seed) if r["question"] not in held_out]
    return train, val


def common_arguments(what: str) -> argparse.ArgumentParser:
    """The options ``dev`` and ``train`` share (a parent parser, with
    :func:`trainer_options`); ``what`` names the rows."""
    common = argparse.ArgumentParser(add_help=False, parents=[trainer_options()])
    common.add_argument("--seed", type=int, default=0, help=f"{what} generation seed")
    common.add_argument("--concurrency", type=int, default=8, help="rollouts at a time")
    return common


def add_commands(
    sub: Any,
    common: argparse.ArgumentParser,
    what: str,
    *,
    dev: Callable[[argparse.Namespace], Any],
    train: Callable[[argparse.Namespace], Any],
) -> None:
    """The ``dev`` and ``train`` subcommands (of :func:`sample_parser`'s ``sub``), calling
    ``dev(args)`` or ``train(args)`` (:func:`run_command`)."""
    d = subcommand(sub, "dev", "run the agent against an endpoint", [common])
    d.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL (.../v1)")
    d.add_argument("--model", required=True, help="model name the endpoint serves")
    d.add_argument("--api-key", default="EMPTY", help="the endpoint's API key")
    d.add_argument("--n", type=int, default=16, help=f"{what} to run")
    d.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    d.add_argument("--max-tokens", type=int, default=512, help="per model call")
    d.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not ask the endpoint for token ids (hosted APIs that reject the field)",
    )
    d.set_defaults(run=dev)

    t = subcommand(sub, "train", "train with LocalRL on this machine", [common])
    t.add_argument("--model", help="model path or hub name (default: the tiny random model)")
    add_resume(t)
    t.add_argument("--steps", type=int, default=2, help="policy updates")
    t.add_argument("--tasks-per-step", type=int, default=4, help=f"{what} per update")
    t.add_argument("--group-size", type=int, default=4, help="rollouts per task")
    t.add_argument("--n-val", type=int, default=8, help=f"held-out {what}")
    t.add_argument("--max-tokens", type=int, default=64, help="per model call")
    t.set_defaults(run=train)


def dev_run(args: argparse.Namespace, agent: Any, name: str, rows: list[dict]) -> vl.RunResult:
    """Run ``agent`` once per row against ``--endpoint``, no training."""
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    llm = vl.LLM(
        endpoint=args.endpoint, model=args.model, api_key=args.api_key, sampling_parameters=sampling
    )
    trainer = vl.Trainer(
        n_runners=1,
        max_concurrency=args.concurrency,
        resources={"main_llm": llm},
        request_token_ids=not args.no_token_ids,
        **trainer_args(args, name),
    )
    return trainer.dev(agent, rows)


def local_rl(
    args: argparse.Namespace, tasks_per_step: int | None = None, **settings: Any
) -> vl.LocalRL:
    """LocalRL on ``--model`` (or the tiny model) as the samples' options say: ``--steps``
    steps of ``--tasks-per-step`` tasks (or ``tasks_per_step``) run ``--group-size`` times,
    sampled at temperature 1 up to ``--max-tokens``, validated greedy before the first update
    and after the last, ``--resume``, ``--seed``; ``settings`` (more of LocalRL's keywords:
    ``update``, ``trajectory``...) on top of one merged row per rollout."""
    from voltrl.trajectory import TrajectoryConfig

    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens}
    options: dict[str, Any] = {
        "schedule": {
            "steps": args.steps,
            "tasks_per_step": tasks_per_step or args.tasks_per_step,
            "group_size": args.group_size,
        },
        "validation": {"sampling": {**sampling, "temperature": 0.0}, "every": args.steps},
        "checkpoints": {"resume": args.resume},
        "sampling": sampling,
        "trajectory": TrajectoryConfig(mode="trajectory"),
        "seed": args.seed,
    }
    return vl.LocalRL(args.model or "tiny", **{**options, **settings})


def train_run(
    args: argparse.Namespace,
    algorithm: vl.LocalRL,
    agent: Any,
    name: str,
    train: list[dict],
    val: list[dict],
) -> vl.RunResult:
    """Train ``agent``'s model with ``algorithm``; prints held-out reward before and after."""
    trainer = vl.Trainer(
        algorithm, n_runners=1, max_concurrency=args.concurrency, **trainer_args(args, name)
    )
    result = trainer.fit(agent, train, val)
    val_reward = [h["val/reward_mean"] for h in algorithm.history if "val/reward_mean" in h]
    if val_reward:
        before, after = val_reward[0], val_reward[-1]
        print(f"held-out reward: {before:.1%} before, {after:.1%} after; run in {result.run_dir}")
    return result
