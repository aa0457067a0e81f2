"""The VERL algorithm's configuration: verl's own Hydra config plus a ``voltrl`` section.

::

    cfg, ours = compose_config(
        {"actor_rollout_ref": {"model": {"path": "Qwen/Qwen2.5-1.5B-Instruct"}},
         "voltrl": {"rollout_weighting": True}},
        overrides=["trainer.total_training_steps=100"],
        preset="1gpu-40gb",
    )

The base is verl's ``ppo_trainer.yaml``, composed by Hydra exactly as ``verl.trainer.main_ppo``
composes it. On top of it, in order: a preset (:data:`PRESETS`), the user's config (a dict, a
YAML file or an OmegaConf config; its ``voltrl`` key is ours), then Hydra-style ``overrides``
(``voltrl.*`` ones are ours). Keys verl does not know are errors (the config is struct), and
the result goes through verl's own ``validate_config`` and its dataclass schemas
(``ActorConfig``, ``RolloutConfig``, ``AlgoConfig``), so a typo fails here, before Ray starts.

Settings VoltRL must own are then fixed (:func:`_wire`): the v1 trainer in ``sync`` mode, our
dataset class and agent-loop manager, rollout logprobs on, and the length limits shared with
the trajectory builder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from voltrl.algorithms.verl.version import require_verl
from voltrl.retry import GatewayRetry
from voltrl.trajectory import TrajectoryConfig
from voltrl.types import Model

ConfigSource = Mapping[str, Any] | str | Path | Any

ADAPTERS_REFUSED = (
    "lora_adapters (a LoRA adapter per agent role) are LocalRL's: verl trains one model, so every "
    "agent's calls train the same weights. Use vl.LocalRL(..., lora_adapters={...}), or train one "
    "role per verl run with voltrl.trajectory.agent_filter (see docs/lora_adapters.md)"
)


class VoltrlSection(Model):
    """The ``voltrl`` section: what VoltRL adds to verl's config.

    Attributes:
        trajectory: :class:`~voltrl.trajectory.TrajectoryConfig` fields (mode, credit, agent
            filter, caps, failed-rollout policy...). ``max_prompt_length`` and
            ``max_response_length`` default to verl's ``data.max_prompt_length`` and
            ``actor_rollout_ref.rollout.response_length``; ``length_policy`` defaults to
            ``"drop"`` (rows over the limits are dropped and counted).
        rollout_weighting: per-rollout normalisation. A rollout that became ``k`` rows gives
            each row ``1/k`` of its weight (advantages scaled by
            :func:`~voltrl.algorithms.local.loss.weight_advantages`), so a rollout with many
            turns does not outweigh one with few.
        rounding: how a batch whose row count is not a multiple of verl's mini-batch size is
            evened out: ``"drop_zero_variance"`` drops rows of GRPO groups whose rewards are all
            equal (they carry no gradient) before letting verl pad the rest; ``"pad"`` leaves
            it all to verl's padding rows.
        ray_address: the Ray cluster to join (``"auto"``, ``"ray://host:10001"``); ``None``
            joins a running local cluster or starts one.
        gateway_host: the address the gateway in front of the vLLM replicas binds to (default:
            the trainer's ``host``); runners on other machines need a reachable one. Off
            loopback the run needs a token (the trainer's, which it always has unless the store
            is a server without one): the gateway checks it and is refused without one.
        gateway_retry: how that gateway retries replica calls (:class:`~voltrl.retry.
            GatewayRetry` fields; default: the trainer's).
        reasoning_split: that gateway hands agents the ``<think>...</think>`` the model writes
            as ``reasoning_content`` (:mod:`voltrl.gateway.reasoning`); training sees every token.
        served_model_name: the model name agents see in their ``LLM`` (default: the name the
            vLLM replicas serve; the gateway always sends that one to them).
        max_wait_s: longest one GRPO group may take before its rollouts count as failed.
    """

    trajectory: dict[str, Any] = Field(default_factory=dict)
    rollout_weighting: bool = False
    rounding: Literal["drop_zero_variance", "pad"] = "drop_zero_variance"
    ray_address: str | None = None
    gateway_host: str | None = None
    gateway_retry: GatewayRetry | None = None
    reasoning_split: bool = False
    served_model_name: str | None = None
    max_wait_s: float | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _no_adapters(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "lora_adapters" in data:
            raise ValueError(ADAPTERS_REFUSED)
        return data

    def trajectory_config(self, verl_config: Any) -> TrajectoryConfig:
        """The trajectory builder's config, with verl's length limits as defaults."""
        fields = {
            "length_policy": "drop",
            "max_prompt_length": int(verl_config.data.max_prompt_length),
            "max_response_length": int(verl_config.actor_rollout_ref.rollout.response_length),
            **self.trajectory,
        }
        return TrajectoryConfig(**fields)


PRESETS: dict[str, dict[str, Any]] = {
    # One 40 GB GPU, a 0.5-1.5B model: FSDP parameter and optimizer offload, gradient
    # checkpointing, small micro-batches, vLLM limited to half the memory.
    "1gpu-40gb": {
        "trainer": {"n_gpus_per_node": 1, "nnodes": 1},
        "data": {"train_batch_size": 16, "max_prompt_length": 1024, "max_response_length": 1024},
        "actor_rollout_ref": {
            "model": {"enable_gradient_checkpointing": True, "use_remove_padding": True},
            "actor": {
                "ppo_mini_batch_size": 8,
                "ppo_micro_batch_size_per_gpu": 2,
                "fsdp_config": {"param_offload": True, "optimizer_offload": True},
            },
            "rollout": {
                "n": 4,
                "tensor_model_parallel_size": 1,
                "gpu_memory_utilization": 0.5,
                "log_prob_micro_batch_size_per_gpu": 4,
            },
            "ref": {"log_prob_micro_batch_size_per_gpu": 4, "fsdp_config": {"param_offload": True}},
        },
    },
    # One 80 GB GPU (A100/H100), a 1.5-3B model: no parameter offload, the optimizer
    # offloaded, gradient checkpointing, micro-batches of long multi-turn rows.
    "1gpu-80gb": {
        "trainer": {"n_gpus_per_node": 1, "nnodes": 1},
        "data": {"train_batch_size": 16, "max_prompt_length": 4096, "max_response_length": 2048},
        "actor_rollout_ref": {
            "model": {"enable_gradient_checkpointing": True, "use_remove_padding": True},
            "actor": {
                "ppo_mini_batch_size": 8,
                "ppo_micro_batch_size_per_gpu": 2,
                "fsdp_config": {"param_offload": False, "optimizer_offload": True},
            },
            "rollout": {
                "n": 8,
                "tensor_model_parallel_size": 1,
                "gpu_memory_utilization": 0.5,
                "log_prob_micro_batch_size_per_gpu": 4,
            },
            "ref": {"log_prob_micro_batch_size_per_gpu": 4, "fsdp_config": {"param_offload": True}},
        },
    },
    # One node with 8 GPUs (80 GB class), models up to ~8B: no offload, bigger batches,
    # vLLM tensor-parallel over 2 GPUs per replica (4 replicas).
    "8gpu": {
        "trainer": {"n_gpus_per_node": 8, "nnodes": 1},
        "data": {"train_batch_size": 64, "max_prompt_length": 2048, "max_response_length": 2048},
        "actor_rollout_ref": {
            "model": {"enable_gradient_checkpointing": True, "use_remove_padding": True},
            "actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8},
            "rollout": {
                "n": 8,
                "tensor_model_parallel_size": 2,
                "gpu_memory_utilization": 0.6,
                "log_prob_micro_batch_size_per_gpu": 16,
            },
            "ref": {"log_prob_micro_batch_size_per_gpu": 16},
        },
    },
}
"""Starting points; every key is verl's own and can be overridden."""

_DRIVER = "voltrl.algorithms.verl.driver"

DEFAULTS: dict[str, Any] = {
    "algorithm": {"adv_estimator": "grpo"},
    "trainer": {"project_name": "voltrl", "logger": ["console"]},
    # the dataset is a list of task ids: loader worker processes would only cost start-up
    "data": {"dataloader_num_workers": 0},
    "actor_rollout_ref": {
        "actor": {"ppo_micro_batch_size_per_gpu": 4},
        "ref": {"log_prob_micro_batch_size_per_gpu": 8},
        "rollout": {
            "log_prob_micro_batch_size_per_gpu": 8,
            "name": "vllm",
            "mode": "async",
            # agents call tools through the OpenAI API: vLLM parses Hermes-style tool calls
            "engine_kwargs": {
                "vllm": {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
            },
        },
    },
}
"""VoltRL's defaults over verl's own, applied before presets: GRPO (verl's default is GAE,
which needs a critic model), micro-batch sizes (verl has none), vLLM rollout servers that
parse Hermes tool calls, metrics to the console (add ``"wandb"``, ``"tensorboard"`` or
``"mlflow"`` to ``trainer.logger``)."""


def _as_container(source: ConfigSource | None) -> dict[str, Any]:
    """A plain dict from a dict, a YAML path or an OmegaConf config."""
    from omegaconf import DictConfig, OmegaConf

    if source is None:
        return {}
    if isinstance(source, str | Path):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"verl config file {path} does not exist")
        source = OmegaConf.load(path)
    if isinstance(source, DictConfig):
        return OmegaConf.to_container(source, resolve=False)  # type: ignore[return-value]
    if isinstance(source, Mapping):
        return OmegaConf.to_container(OmegaConf.create(dict(source)), resolve=False)  # type: ignore[return-value]
    raise TypeError(f"a verl config is a dict, a YAML path or a DictConfig, not {type(source)}")


def compose_config(
    config: ConfigSource | None = None,
    overrides: Sequence[str] = (),
    *,
    preset: str | None = None,
    validate: bool = True,
) -> tuple[Any, VoltrlSection]:
    """Compose verl's config with a preset, the user's config and overrides.

    Returns ``(verl_config, voltrl_section)``: an OmegaConf ``DictConfig`` of verl's schema
    and our :class:`VoltrlSection`. Raises ``ValueError`` (with verl's or OmegaConf's message)
    for unknown keys, values of the wrong type, or settings verl rejects, and
    :class:`~voltrl.algorithms.verl.version.VerlUnavailableError` without a supported verl.
    """
    require_verl()
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {sorted(PRESETS)}")
    user = _as_container(config)
    ours = dict(user.pop("voltrl", None) or {})
    verl_overrides = [o for o in overrides if not o.lstrip("+~").startswith("voltrl.")]
    our_overrides = [o for o in overrides if o.lstrip("+~").startswith("voltrl.")]
    if our_overrides:
        dotted = OmegaConf.to_container(OmegaConf.from_dotlist(our_overrides))
        ours = OmegaConf.to_container(OmegaConf.merge(ours, dotted["voltrl"]))  # type: ignore[index,assignment]
    try:
        with initialize_config_module("verl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer")
        # free-form maps passed through to vLLM and to ray.init: any key is valid there
        OmegaConf.set_struct(cfg.actor_rollout_ref.rollout.engine_kwargs, False)
        OmegaConf.set_struct(cfg.ray_kwargs.ray_init, False)
        dotted = OmegaConf.from_dotlist([o.lstrip("+") for o in verl_overrides])
        cfg = OmegaConf.merge(cfg, DEFAULTS, PRESETS.get(preset or "", {}), user, dotted)
    except OmegaConfBaseException as e:
        raise ValueError(f"invalid verl config: {e}") from None
    section = VoltrlSection(**ours)
    _wire(cfg)
    if validate:
        validate_config(cfg)
    return cfg, section


def _wire(cfg: Any) -> None:
    """Fix the settings VoltRL's integration depends on (see ``docs/verl.md``)."""
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.trainer.use_v1 = True
        cfg.actor_rollout_ref.rollout.calculate_log_probs = True
        cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class = (
            f"{_DRIVER}.VoltAgentLoopManager"
        )
        cfg.data.custom_cls.path = f"pkg://{_DRIVER}"
        cfg.data.custom_cls.name = "VoltTaskDataset"
        cfg.data.return_raw_chat = True


def validate_config(cfg: Any) -> None:
    """Run verl's own validation and schema conversion, plus VoltRL's own constraints."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.config import validate_config as verl_validate

    mode = cfg.trainer.v1.trainer_mode
    if mode != "sync":
        raise ValueError(
            f"trainer.v1.trainer_mode={mode!r}: VoltRL drives verl's synchronous trainer "
            "(trainer_mode=sync); the async modes need verl's own agent loops"
        )
    if cfg.actor_rollout_ref.rollout.mode != "async":
        raise ValueError("actor_rollout_ref.rollout.mode must be 'async' (vLLM HTTP servers)")
    try:
        verl_validate(
            cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
        )
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
        omega_conf_to_dataclass(cfg.algorithm)
    except (AssertionError, TypeError, ValueError, OmegaConfBaseException, HydraException) as e:
        raise ValueError(f"verl rejected the config: {e}") from e
