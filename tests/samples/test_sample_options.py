"""Every sample's ``run.py`` takes the trainer's options from one shared parser
(``samples/sample_cli.py``): ``--run-dir``, ``--name`` and ``--loggers`` for ``dev`` and
``train``, ``--resume`` for ``train``; its ``--help`` shows each option's default in one
format; a bad ``--loggers`` or a ``--resume`` without ``--name`` is a usage error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import SAMPLES
from sample_options import check_sample_options


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("sample", "train_defaults"),
    [
        ("agent_service", {"--steps": "2", "--group-size": "4", "--concurrency": "8"}),
        ("autogen_calc", {"--steps": "2", "--n-val": "8", "--seed": "0"}),
        ("calc_mcp", {"--steps": "2", "--train-tasks": "200", "--max-tokens": "48"}),
        ("sql_agent", {"--steps": "2", "--lr": "1e-05", "--seed": "0", "--val-limit": "2"}),
        ("tau2_airline", {"--steps": "2", "--max-prompt-length": "6144", "--lr": "0.0001"}),
    ],
)
def test_every_samples_run_py_takes_the_trainers_options_from_the_shared_parser(
    sample: str, train_defaults: dict[str, str]
):
    check_sample_options(sample, train_defaults)


def test_sample_cli_reads_loggers_as_voltrl_train_and_dev_do(tmp_path: Path):
    sys.path.insert(0, str(SAMPLES))
    import sample_cli

    from voltrl.cli.main import build_parser

    parser, sub = sample_cli.sample_parser("a sample")
    sample_cli.subcommand(sub, "train", "train it", [sample_cli.trainer_options()])
    args = parser.parse_args(["train", "--loggers", "tensorboard, wandb", "--out", str(tmp_path)])
    assert args.loggers == ["tensorboard", "wandb"] and args.run_dir == tmp_path
    assert sample_cli.trainer_args(args, "default") == {
        "run_dir": tmp_path, "name": "default", "loggers": ["tensorboard", "wandb"],
    }  # fmt: skip
    (tmp_path / "default" / "metrics.jsonl").parent.mkdir()
    (tmp_path / "default" / "metrics.jsonl").write_text("")  # a run of the name: this is -2
    assert sample_cli.run_name(args, "default") == "default-2"
    args.resume = True  # ... unless it resumes that run
    assert sample_cli.run_name(args, "default") == "default"
    given = ["--loggers", "tensorboard, wandb"]
    assert build_parser().parse_args(["train", "x.yaml", *given]).loggers == args.loggers
    dev = ["dev", "m:a", "--data", "d", "--llm-endpoint", "u", "--model", "m", *given]
    assert build_parser().parse_args(dev).loggers == args.loggers
