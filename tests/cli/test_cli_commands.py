"""The ``voltrl`` command line is a module per command, each registering its own parser
(``voltrl.cli.main`` only gathers them)."""

from __future__ import annotations

import argparse

import pytest

from voltrl.cli import audit, dashboard, dev, model, runner, runs, serve, show, teacher, train
from voltrl.cli.main import build_parser

COMMANDS = {
    dev: ["dev", "m:a", "--data", "t.jsonl", "--llm-endpoint", "http://h/v1", "--model", "x"],
    train: ["train", "train.yaml"],
    runs: ["runs", "--wide"],
    show: ["show", "my-run"],
    audit: ["audit", "my-run", "--json"],
    serve: ["gateway", "--store", "http://h:1", "--backend", "http://b/v1"],
    dashboard: ["dashboard", "runs"],
    runner: ["runner", "--store", "http://h:1", "--agent", "m:a"],
    model: ["model", "serve", "tiny"],
    teacher: ["teacher", "serve", "my_teacher.py:policy"],
}


@pytest.mark.parametrize("module", COMMANDS, ids=lambda m: m.__name__)
def test_a_command_module_registers_its_command_on_a_parser_of_its_own(module) -> None:
    parser = argparse.ArgumentParser(prog="voltrl")
    module.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(COMMANDS[module])
    assert args.command == COMMANDS[module][0] and callable(args.func)
    assert args.func.__module__ == module.__name__


def test_voltrl_has_exactly_the_commands_its_modules_register() -> None:
    def commands(parser: argparse.ArgumentParser) -> set[str]:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return set(sub.choices)

    gathered = argparse.ArgumentParser()
    sub = gathered.add_subparsers()
    for module in COMMANDS:
        module.register(sub)
    assert commands(build_parser()) == commands(gathered)
    assert commands(gathered) == {
        "dev",
        "train",
        "runs",
        "show",
        "audit",
        "serve",
        "gateway",
        "dashboard",
        "runner",
        "model",
        "teacher",
    }
