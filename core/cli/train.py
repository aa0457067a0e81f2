"""``voltrl train CONFIG.yaml``: train an agent as a YAML config says.

The config is checked whole before anything starts (:func:`build_from_config`): a config that
cannot run (no model, a misspelt setting, a missing file or store, an agent that does not
load) is one line naming the field, and no run directory is made.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.cli.agents import load_agent
from voltrl.cli.options import add_loggers_arg
from voltrl.errors import VoltRLError

if TYPE_CHECKING:
    from voltrl.cli.options import Subparsers

SECTIONS = ("agent", "data", "algorithm", "trainer")
"""The sections of a ``voltrl train`` config."""


def register(sub: Subparsers) -> None:
    """Add ``voltrl train`` to the ``voltrl`` parser."""
    train = sub.add_parser("train", help="train an agent as a YAML config says")
    train.add_argument("config", help="YAML: agent, data, algorithm, trainer")
    add_loggers_arg(train)
    train.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="run the runners as actors on this Ray cluster (auto, host:6379, "
        "ray://host:10001): trainer.runners.ray.address",
    )
    train.set_defaults(func=_command)


def build_from_config(config: dict[str, Any]) -> tuple[Any, Any, str, str | None]:
    """``(trainer, agent, train data, val data)`` from a ``voltrl train`` config.

    The config has ``agent`` (MODULE:AGENT), ``data`` (``train``, optional ``val``: files),
    ``algorithm`` (``name``: ``local_rl``, ``sft``, ``apo`` or ``baseline``, and that algorithm's
    arguments; LocalRL's ``update``, ``trajectory``, ``warm_start`` (SFT's arguments) and
    ``prompt_search`` (APO's arguments) sections are their configs) and ``trainer``
    (:class:`~voltrl.Trainer` arguments; ``resources`` maps names to LLM fields; ``runners``
    is ``ray`` or ``{ray: {...}}``, :class:`~voltrl.RayRunners`' settings).
    Raises :class:`VoltRLError` naming the field (``algorithm.model``, ``data.train``...)
    of the first thing that cannot run, before anything is started or written.
    """
    from voltrl.resources import LLM
    from voltrl.runtime import Trainer

    if unknown := sorted(set(config) - set(SECTIONS)):
        raise VoltRLError(f"unknown config sections {unknown}; use {', '.join(SECTIONS)}")
    for key in ("agent", "data"):
        if key not in config:
            raise VoltRLError(f"the config needs a {key!r} section")
    data = config["data"]
    if not isinstance(data, dict) or "train" not in data:
        raise VoltRLError("data needs a 'train' file (and optionally 'val')")
    if unknown := sorted(set(data) - {"train", "val"}):
        raise VoltRLError(f"data.{unknown[0]}: unknown field; data has train and val")
    algorithm = _algorithm(dict(config.get("algorithm") or {"name": "baseline"}))
    trainer_cfg = dict(config.get("trainer") or {})
    _check_fields("trainer", trainer_cfg, Trainer)
    try:
        if "resources" in trainer_cfg:
            if not isinstance(trainer_cfg["resources"] or {}, dict):
                raise VoltRLError("trainer.resources: a mapping of names to LLMs, not a list")
            trainer_cfg["resources"] = {
                name: _validated(LLM, f"trainer.resources.{name}", value)
                for name, value in (trainer_cfg["resources"] or {}).items()
            }
        if "runners" in trainer_cfg:
            trainer_cfg["runners"] = _runners(trainer_cfg["runners"])
        trainer = Trainer(algorithm, **trainer_cfg)
    except (TypeError, ValueError) as exc:
        raise VoltRLError(f"trainer: {exc}") from None
    for split in ("train", "val"):
        if data.get(split) is not None and not Path(str(data[split])).is_file():
            raise VoltRLError(f"data.{split}: file {data[split]} does not exist")
    return trainer, _agent(config["agent"]), data["train"], data.get("val")


def _runners(value: Any) -> Any:
    """``trainer.runners``: ``ray`` (Ray runners with their defaults) or ``{ray: {...}}``
    (:class:`~voltrl.runtime.ray_runners.RayRunners`' settings); null: this machine's."""
    from voltrl.runtime.ray_runners import RayRunners

    if value is None:
        return None
    if value == "ray":
        value = {"ray": {}}
    if not isinstance(value, dict) or set(value) != {"ray"}:
        raise VoltRLError("trainer.runners: ray, or {ray: {n: 4, address: auto, ...}}")
    settings = value["ray"] or {}
    if not isinstance(settings, dict):
        raise VoltRLError("trainer.runners.ray: a mapping of RayRunners settings")
    try:
        return RayRunners.from_config(settings)
    except (TypeError, ValueError) as exc:
        raise VoltRLError(f"trainer.runners.ray: {exc}") from None


def _algorithm(algo_cfg: dict[str, Any]) -> Any:
    """The ``algorithm`` section's algorithm, each field checked (see :func:`build_from_config`)."""
    from voltrl.algorithms.baseline import Baseline

    name = algo_cfg.pop("name", "baseline")
    if name == "baseline":
        _check_fields("algorithm", algo_cfg, Baseline)
        return _built(Baseline, "algorithm", algo_cfg)
    if name == "apo":
        return _apo(algo_cfg)
    if name not in ("local_rl", "sft"):
        raise VoltRLError(
            f"algorithm.name: unknown algorithm {name!r}; use local_rl, sft, apo or baseline"
        )
    from voltrl.algorithms.local import SFT, LocalRL
    from voltrl.algorithms.local.config import FLAT, GROUPS, into_groups
    from voltrl.algorithms.local.update_config import PolicyUpdateConfig
    from voltrl.trajectory import TrajectoryConfig

    _check_model("algorithm.model", algo_cfg.get("model"))
    if name == "sft":
        _check_sft("algorithm", algo_cfg)
        return _built(SFT, "algorithm", algo_cfg)
    _check_fields("algorithm", algo_cfg, LocalRL, also=FLAT)
    if flat := [key for key in algo_cfg if key in FLAT]:  # a train.yaml of VoltRL 0.1
        moved = ", ".join(f"{key} is {'.'.join(FLAT[key])}" for key in flat)
        print(f"note: algorithm settings are grouped since VoltRL 0.2: {moved}", file=sys.stderr)
        try:
            algo_cfg = into_groups(algo_cfg)
        except ValueError as exc:
            raise VoltRLError(f"algorithm: {exc}") from None
    groups = {**GROUPS, "update": PolicyUpdateConfig, "trajectory": TrajectoryConfig}
    for key, model in groups.items():
        if algo_cfg.get(key) is not None:
            _validated(model, f"algorithm.{key}", algo_cfg[key])
    if (warm := algo_cfg.get("warm_start")) is not None:  # a recorded config has it as null
        if not isinstance(warm, dict):
            raise VoltRLError("algorithm.warm_start: expected SFT's settings (a mapping)")
        if warm.get("model") is not None:
            raise VoltRLError("algorithm.warm_start.model: leave it out (it trains LocalRL's)")
        warm = {k: v for k, v in warm.items() if k != "model"}
        _check_sft("algorithm.warm_start", warm)
        algo_cfg["warm_start"] = _built(SFT, "algorithm.warm_start", warm)
    if (search := algo_cfg.get("prompt_search")) is not None:  # null in a recorded config
        if not isinstance(search, dict):
            raise VoltRLError("algorithm.prompt_search: expected APO's settings (a mapping)")
        search = {k: v for k, v in search.items() if k != "name"}
        algo_cfg["prompt_search"] = _apo(search, "algorithm.prompt_search", optimizer=False)
    return _built(LocalRL, "algorithm", algo_cfg)


def _apo(algo_cfg: dict[str, Any], where: str = "algorithm", optimizer: bool = True) -> Any:
    """APO from its section: ``prompt`` (a template string, or ``{template, engine}``),
    ``optimizer_llm`` (LLM fields; under LocalRL's ``prompt_search``, not ``optimizer``, it
    may be null: the model being trained), the optimizer prompts like ``prompt``, and the
    rest."""
    from voltrl.algorithms.apo import APO
    from voltrl.resources import LLM, PromptTemplate

    _check_fields(where, algo_cfg, APO)
    for key in ("prompt", "optimizer_llm") if optimizer else ("prompt",):
        if algo_cfg.get(key) is None:
            raise VoltRLError(f"{where}.{key}: APO needs it")
    if algo_cfg.get("optimizer_llm") is not None:
        algo_cfg["optimizer_llm"] = _validated(
            LLM, f"{where}.optimizer_llm", algo_cfg["optimizer_llm"]
        )
    for key in ("prompt", "critique_prompt", "rewrite_prompt"):
        if isinstance(algo_cfg.get(key), dict):
            algo_cfg[key] = _validated(PromptTemplate, f"{where}.{key}", algo_cfg[key])
    try:
        return APO(**algo_cfg)
    except (TypeError, ValueError, VoltRLError) as exc:
        raise VoltRLError(f"{where}: {exc}") from None


def _check_fields(
    where: str, given: dict[str, Any], target: Callable[..., Any], also: Iterable[str] = ()
) -> None:
    """A setting ``target`` does not take (from a config) is an error naming it, and the
    nearest one it takes; ``also``: more names it takes through ``**kwargs``."""
    objects = ("self", "tokenizer", "algorithm")  # objects, which no config holds
    params = inspect.signature(target).parameters.values()
    named = [p.name for p in params if p.kind is not p.VAR_KEYWORD and p.name not in objects]
    known = [*named, *also]
    for key in given:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise VoltRLError(f"{where}.{key}: unknown field{hint}")


def _check_model(where: str, model: Any) -> None:
    """The model must be a name or path that can load: ``tiny``, a hub name, a directory."""
    if model is None:
        raise VoltRLError(
            f"{where}: none given (a run given a model object records null): set it to a "
            "model directory, a hub name or tiny"
        )
    if not isinstance(model, str):
        raise VoltRLError(f"{where}: expected a model directory, a hub name or tiny")
    if model == "tiny" or Path(model).expanduser().exists():
        return
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ModuleNotFoundError:  # LocalRL's own check says what to install
        return
    try:
        validate_repo_id(model)
    except HFValidationError:
        raise VoltRLError(f"{where}: the directory {model} does not exist") from None


def _check_sft(where: str, sft: dict[str, Any]) -> None:
    """SFT's fields, and its sources: each a store or run directory that exists."""
    from voltrl.algorithms.local import SFT
    from voltrl.store import parse_store

    _check_fields(where, sft, SFT)
    if "source" not in sft:
        raise VoltRLError(f"{where}.source: none given (run directories or stores to learn from)")
    sources = sft["source"] if isinstance(sft["source"], list) else [sft["source"]]
    for source in sources:
        try:
            parse_store(source, existing=True)
        except VoltRLError as exc:
            raise VoltRLError(f"{where}.source: {exc}") from None


def _validated(model: Any, where: str, value: Any) -> Any:
    """``value`` as the pydantic ``model``; its first error names the field."""
    from pydantic import ValidationError

    try:
        return model.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(map(str, (where, *error["loc"])))
        raise VoltRLError(f"{field}: {error['msg']}") from None


def _built(cls: Callable[..., Any], where: str, settings: dict[str, Any]) -> Any:
    try:
        return cls(**settings)
    except (TypeError, ValueError) as exc:
        raise VoltRLError(f"{where}: {exc}") from None


def _agent(spec: Any) -> Any:
    if not isinstance(spec, str) or spec == "MODULE:AGENT":
        raise VoltRLError(
            f"agent: {spec!r} names no agent; set it to MODULE:AGENT or path/to/file.py:AGENT"
        )
    try:
        return load_agent(spec)
    except VoltRLError as exc:
        raise VoltRLError(f"agent: {exc}") from None
    except TypeError as exc:  # a class whose constructor needs arguments
        raise VoltRLError(f"agent: cannot build {spec}: {exc}") from None


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
    if args.loggers:
        config["trainer"] = {**(config.get("trainer") or {}), "loggers": args.loggers}
    if args.ray_address:
        trainer_cfg = dict(config.get("trainer") or {})
        runners = trainer_cfg.get("runners")
        ray = dict(runners.get("ray") or {}) if isinstance(runners, dict) else {}
        trainer_cfg["runners"] = {"ray": {**ray, "address": args.ray_address}}
        config["trainer"] = trainer_cfg
    trainer, agent, train, val = build_from_config(config)
    result = trainer.fit(agent, train, val)
    # an RL run that ran no rollout did nothing; SFT alone runs none by design
    return 0 if result.stats.rollouts or trainer.algorithm.name == "sft" else 1
