"""A LocalRL run's weights on disk: its checkpoints, the step it resumes from, its final model.

::

    <run dir>/checkpoints/step_00000010/              model.pt, optimizer.pt, state.pt
    <run dir>/checkpoints/<adapter>/step_00000010/    the same, per LoRA adapter
    <run dir>/final/                                  from_pretrained loads it (LoRA merged)
    <run dir>/final/adapter/  or  final/adapters/<adapter>/     the LoRA adapters, for peft

:func:`save_trainer` (``PolicyTrainer.save_checkpoint``) writes a trainer's folder under a
temporary name, fsyncs it and renames it, so a folder with a ``state.pt`` is complete;
:func:`load_trainer` (``PolicyTrainer.load_checkpoint``) restores one. With LoRA a
checkpoint holds the adapters and the optimizer; ``final/`` holds the merged model
(``AutoModelForCausalLM.from_pretrained`` loads it) and the adapter alone, which
``PeftModel.from_pretrained(base_model, ...)`` loads onto the model training started from.

:func:`save_checkpoints` saves a step's checkpoints and keeps only the latest
``checkpoints.keep`` (a full fine-tune's checkpoint is about 14 bytes a parameter: 7 GB for
0.5B); a disk that fills during a save fails the run with the last complete checkpoint named.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voltrl.errors import VoltRLError

if TYPE_CHECKING:
    from voltrl.algorithms.local.update import PolicyTrainer

CHECKPOINT_PREFIX = "step_"
CHECKPOINTS_DIR = "checkpoints"
"""``<run dir>/checkpoints``."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """Where :func:`save_trainer` puts the
    checkpoint of ``step``."""
    return Path(directory) / f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_steps(directory: str | Path) -> set[int]:
    """The steps of the complete checkpoints under ``directory``."""
    return {
        int(p.name[len(CHECKPOINT_PREFIX) :])
        for p in Path(directory).glob(f"{CHECKPOINT_PREFIX}*")
        if p.is_dir() and p.name[len(CHECKPOINT_PREFIX) :].isdigit() and (p / "state.pt").exists()
    }


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint with the highest step under ``directory`` (``step_00000012/``...), or
    ``None`` when there is none."""
    steps = checkpoint_steps(directory)
    return checkpoint_path(directory, max(steps)) if steps else None


def checkpoint_dir(run_dir: Path, adapter: str | None, step: int | None = None) -> Path:
    """``<run dir>/checkpoints`` (``/<adapter>`` with adapters; ``/step_N`` with ``step``)."""
    root = run_dir / CHECKPOINTS_DIR
    root = root if adapter is None else root / adapter
    return root if step is None else checkpoint_path(root, step)


def durable_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path``, flushed to the disk (fsync) before it returns."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename into it, say) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_trainer(trainer: PolicyTrainer, root: Path, step: int) -> Path:
    """Save ``trainer`` to ``root/step_{step:08d}/``: ``model.pt`` (the adapter weights with
    LoRA, else the full model), ``optimizer.pt``, ``masters.pt`` (the float32 copies of
    half-precision weights, when there are any: :mod:`~voltrl.models.precision`) and
    ``state.pt`` (step, the updates this trainer did, the torch/CUDA/Python RNG states, the
    mini-batch shuffle generator, the config). Written to a temporary folder and renamed, so a
    crash never leaves a half checkpoint that :func:`latest_checkpoint` would pick; each file
    and the folders are fsynced before and after the rename, so a checkpoint named complete
    survives a power cut. A failed save (a full disk) removes what it wrote and raises."""
    import torch

    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(root, step)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {
        "step": step,
        "updates": trainer.global_step,
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python_rng": random.getstate(),
        "generator": trainer.generator.get_state(),
        "config": trainer.config.model_dump(mode="json"),
    }
    weights = (
        trainer.adapter_state_dict() if trainer.config.use_lora else trainer.model.state_dict()
    )
    parts = {"model.pt": weights, "optimizer.pt": trainer.optimizer.state_dict()}
    if trainer.masters.masters:
        parts["masters.pt"] = trainer.masters.state_dict()
    try:
        for name, obj in [*parts.items(), ("state.pt", state)]:  # state.pt last: complete
            durable_save(obj, tmp / name)
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
        raise
    return final


def load_trainer(trainer: PolicyTrainer, path: Path) -> int:
    """Restore ``trainer``'s weights, optimizer, step and RNG states from a checkpoint folder,
    or from the latest one under ``path``. Returns the step restored (the run's, which
    ``global_step`` may not equal: it counts this trainer's own updates). The model must be
    built as for the run that saved it (with LoRA, the same base model: only adapters are
    saved). A float32 run's checkpoint resumed in half precision gives the float32 masters
    the values ``model.pt`` holds, not the model's rounded copies. Raises
    ``FileNotFoundError`` when there is no checkpoint."""
    import torch

    folder = path
    if not (folder / "state.pt").exists():
        found = latest_checkpoint(folder)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {folder}")
        folder = found
    device = trainer.device
    weights = torch.load(folder / "model.pt", map_location=device, weights_only=True)
    if trainer.config.use_lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(trainer.model, weights, adapter_name=trainer.adapter or "default")
    else:
        trainer.model.load_state_dict(weights)
    if (folder / "masters.pt").exists():  # float32 weights, a run's since it began in half
        masters = torch.load(folder / "masters.pt", map_location=device, weights_only=True)
        trainer.masters.load_state_dict(masters)
    else:  # a float32 run's weights, now in half precision: model.pt holds them exactly
        trainer.masters.params_to_masters()
        if not trainer.config.use_lora:  # (LoRA adapters are float32 already)
            names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
            trainer.masters.take_float32(
                {i: weights.get(names[i]) for i in trainer.masters.masters}
            )
    trainer.optimizer.load_state_dict(
        torch.load(folder / "optimizer.pt", map_location=device, weights_only=True)
    )
    state = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    trainer.generator.set_state(state["generator"])
    # a trainer of one LoRA adapter may have done fewer updates than the run has steps
    trainer.global_step = int(state.get("updates", state["step"]))
    trainer.mid_update = False
    return int(state["step"])


def save_checkpoints(
    run_dir: Path, policies: Mapping[str | None, PolicyTrainer], step: int, keep: int | None
) -> Path:
    """Save each trainer's checkpoint of ``step`` (one already saved stays), then remove all
    but the latest ``keep`` (None: keep all; :func:`prune_checkpoints`). Returns
    ``checkpoints/step_N`` (with adapters: ``checkpoints``). A save that fails on the disk
    (full, say) raises :class:`VoltRLError` naming the last complete checkpoint, which the
    failed save left intact."""
    for key, policy in policies.items():
        root = checkpoint_dir(run_dir, key)
        if step in checkpoint_steps(root):
            continue
        try:
            policy.save_checkpoint(root, step)
        except OSError as exc:
            names = [k for k in policies if k is not None] or None
            try:
                last = resume_step(checkpoint_dir(run_dir, None), names)
            except VoltRLError:  # the adapters share no step
                last = None
            if last is None:
                kept = "none"
            elif names is None:
                kept = str(checkpoint_dir(run_dir, None, last))
            else:
                kept = f"step {last} of every adapter in {checkpoint_dir(run_dir, None)}"
            full = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise VoltRLError(
                f"cannot save the checkpoint of step {step} in {root}{full}: {exc}; the last "
                f"complete checkpoint is {kept}: free some space (or lower checkpoints.keep), "
                "then checkpoints.resume continues from it"
            ) from exc
    names = [k for k in policies if k is not None] or None
    prune_checkpoints(run_dir, names, keep)
    return checkpoint_dir(run_dir, None, step if names is None else None)


def prune_checkpoints(run_dir: Path, adapters: Sequence[str] | None, keep: int | None) -> None:
    """Remove the checkpoints older than the ``keep`` latest complete ones (with adapters, the
    latest steps every adapter has), and what interrupted saves left (``.tmp-*``)."""
    roots = (
        [checkpoint_dir(run_dir, a) for a in adapters] if adapters else [run_dir / CHECKPOINTS_DIR]
    )
    for root in roots:
        for tmp in root.glob(f".tmp-{CHECKPOINT_PREFIX}*"):
            shutil.rmtree(tmp, ignore_errors=True)
    if keep is None:
        return
    common = set.intersection(*(checkpoint_steps(root) for root in roots))
    kept = sorted(common)[-keep:]
    if not kept:
        return
    for root in roots:
        for old in checkpoint_steps(root):
            if old < kept[0]:
                shutil.rmtree(checkpoint_path(root, old), ignore_errors=True)


def resume_step(root: Path, adapters: Sequence[str] | None) -> int | None:
    """The step a run resumes from: the latest checkpoint under ``root``, or with LoRA
    ``adapters`` the latest step every adapter has a checkpoint of (an interrupted save may
    have left one ahead); ``None`` when there is none. Checkpoints that do not fit the run
    (per adapter for a run without, or an adapter missing) are an error."""
    names = list(adapters or [])
    per_adapter = {name: checkpoint_steps(root / name) for name in names}
    whole = checkpoint_steps(root)
    other = [p.name for p in root.glob("*/") if p.is_dir() and checkpoint_steps(p)]
    if adapters is None:
        if other and not whole:
            raise VoltRLError(
                f"cannot resume: the checkpoints in {root} are per LoRA adapter "
                f"({', '.join(sorted(other))}); pass the run's lora_adapters"
            )
        return max(whole, default=None)
    if whole and not any(per_adapter.values()):
        raise VoltRLError(
            f"cannot resume: the checkpoints in {root} are of a run without lora_adapters"
        )
    if not any(per_adapter.values()):
        return None
    missing = [name for name, steps in per_adapter.items() if not steps]
    if missing:
        raise VoltRLError(
            f"cannot resume: adapter(s) {', '.join(missing)} have no checkpoint in {root} "
            f"(an adapter added since the run started cannot resume with it)"
        )
    common = set.intersection(*per_adapter.values())
    if not common:
        raise VoltRLError(f"cannot resume: the adapters' checkpoints in {root} share no step")
    return max(common)


def save_final(
    directory: Path,
    served: Any,
    tokenizer: Any,
    policies: Mapping[str | None, PolicyTrainer],
    adapters: Sequence[str] | None,
) -> None:
    """Save the ``served`` model (LoRA merged in) and the tokenizer to ``directory``, which
    ``from_pretrained`` loads; with LoRA also the adapter alone to ``directory/adapter``,
    which ``PeftModel.from_pretrained(base_model, ...)`` loads. With ``adapters`` (a trainer
    each in ``policies``): the base model to ``directory`` and each adapter to
    ``directory/adapters/<name>``."""
    from voltrl.models.loading import quiet_transformers

    with quiet_transformers():
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        if adapters is None:
            served.save_pretrained(directory)
            if policies[None].config.use_lora:
                policies[None].model.save_pretrained(directory / "adapter")
            return
        peft_model = policies[adapters[0]].model
        base = peft_model.get_base_model()
        weights = {
            k.replace(".base_layer", ""): v
            for k, v in base.state_dict().items()
            if "lora_" not in k
        }
        base.save_pretrained(directory, state_dict=weights)
        peft_model.save_pretrained(directory / "adapters", selected_adapters=list(adapters))
