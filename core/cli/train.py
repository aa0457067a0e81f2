"""``voltrl train CONFIG.yaml``: train an agent as a YAML config says."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.cli.agents import load_agent
from voltrl.errors import VoltRLError

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers


def register(sub: Subparsers) -> None:
    """Add ``voltrl train`` to the ``voltrl`` parser."""
    train = sub.add_parser("train", help="train an agent as a YAML config says")
    train.add_argument("config", help="YAML: agent, data, algorithm, trainer")
    train.set_defaults(func=_command)


def build_from_config(config: dict[str, Any]) -> tuple[Any, Any, str, str | None]:
    """``(trainer, agent, train data, val data)`` from a ``voltrl train`` config.

    The config has ``agent`` (MODULE:AGENT), ``data`` (``train``, optional ``val``: files),
    ``algorithm`` (``name``: ``local_rl``, ``sft`` or ``baseline``, and that algorithm's
    arguments; LocalRL's ``update``, ``trajectory`` and ``warm_start`` (SFT's arguments)
    sections are their configs) and ``trainer``
    (:class:`~voltrl.Trainer` arguments; ``resources`` maps names to LLM fields).
    """
    from voltrl.algorithms.baseline import Baseline
    from voltrl.resources import LLM
    from voltrl.runtime import Trainer

    unknown = set(config) - {"agent", "data", "algorithm", "trainer"}
    if unknown:
        raise VoltRLError(f"unknown config sections {sorted(unknown)}")
    for key in ("agent", "data"):
        if key not in config:
            raise VoltRLError(f"the config needs a {key!r} section")
    data = config["data"]
    if not isinstance(data, dict) or "train" not in data:
        raise VoltRLError("data needs a 'train' file (and optionally 'val')")
    algo_cfg = dict(config.get("algorithm") or {"name": "baseline"})
    name = algo_cfg.pop("name", "baseline")
    try:
        if name == "local_rl":  # its update and trajectory sections are taken as dicts
            from voltrl.algorithms.local import SFT, LocalRL

            if algo_cfg.get("warm_start") is not None:  # a recorded config has it as null
                algo_cfg["warm_start"] = SFT(**algo_cfg["warm_start"])
            algorithm: Any = LocalRL(**algo_cfg)
        elif name == "sft":
            from voltrl.algorithms.local import SFT

            algorithm = SFT(**algo_cfg)
        elif name == "baseline":
            algorithm = Baseline(**algo_cfg)
        else:
            raise VoltRLError(f"unknown algorithm {name!r}; use local_rl, sft or baseline")
        trainer_cfg = dict(config.get("trainer") or {})
        if "resources" in trainer_cfg:
            trainer_cfg["resources"] = {k: LLM(**v) for k, v in trainer_cfg["resources"].items()}
        trainer = Trainer(algorithm, **trainer_cfg)
    except (TypeError, ValueError) as exc:
        raise VoltRLError(f"bad config: {exc}") from None
    return trainer, load_agent(config["agent"]), data["train"], data.get("val")


def _command(args: argparse.Namespace) -> int:
    import yaml

    path = Path(args.config)
    if not path.exists():
        raise VoltRLError(f"config file {path} does not exist")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise VoltRLError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise VoltRLError(f"{path}: the config must be a mapping")
    trainer, agent, train, val = build_from_config(config)
    result = trainer.fit(agent, train, val)
    # an RL run that ran no rollout did nothing; SFT alone runs none by design
    return 0 if result.stats.rollouts or trainer.algorithm.name == "sft" else 1
