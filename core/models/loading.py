"""What a ``model`` argument names, loaded: :func:`load_model`, the one place that decides it
for LocalRL, SFT and ``voltrl model serve``. The built-in tiny model (:mod:`.tiny`), a packaged
model fetched on first use (:mod:`.packaged`), a local directory or a Hugging Face hub name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from voltrl.errors import VoltRLError
from voltrl.models.packaged import PACKAGED_MODELS, fetch_model
from voltrl.models.precision import resolve_dtype
from voltrl.models.tiny import TINY, build_tiny, build_tiny_tokenizer


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own progress bars ("Loading weights", "Writing model shards") off while
    VoltRL loads or saves a model, so a run's console shows VoltRL's progress alone; as they
    were afterwards."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_model(
    model: str | Path | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    device: str | None = None,
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer that a ``model`` argument names, on ``device`` (default: CUDA
    if available, else CPU), in ``dtype`` (``"auto"``: bfloat16 on CUDA, float32 elsewhere;
    :func:`~voltrl.models.precision.resolve_dtype`). The one place that decides it,
    for LocalRL, SFT and ``voltrl model serve``:

    - :data:`TINY`: the built-in tiny model (``seed`` picks its weights) and tokenizer;
    - a packaged model's name (:data:`~.packaged.PACKAGED_MODELS`, e.g.
      ``"smollm2-135m-instruct"``): its directory, fetched into the cache on first use;
    - a path or hub name: ``from_pretrained`` in ``dtype``, and its tokenizer unless given (a
      hub name from the Hugging Face cache alone when the hub cannot be reached);
    - a loaded model: as it is (its own dtype), with ``tokenizer`` (required).

    Raises :class:`~voltrl.errors.VoltRLError` when ``from_pretrained`` cannot load it, at
    once and in one line for a directory that does not exist or a hub name neither cached
    nor reachable.
    """
    if tokenizer is None and not isinstance(model, str | Path):
        raise ValueError("pass tokenizer= with a model object")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = resolve_dtype(dtype, device)
    if model == TINY:
        model, tiny_tokenizer = build_tiny(seed=seed)
        model = model.to(torch_dtype)
        tokenizer = tokenizer or tiny_tokenizer
    elif isinstance(model, str | Path):
        if isinstance(model, str) and model in PACKAGED_MODELS:
            model = fetch_model(model)
        model, tokenizer = _from_pretrained(model, tokenizer, torch_dtype)
    assert tokenizer is not None
    # The engine refuses a prompt longer than the model's context with its own error, and
    # trajectories drop or cut rows past max_prompt_length, so transformers' warning about
    # "indexing errors" for a long tokenized prompt (an agent's tools and history) is noise.
    if isinstance(warned := getattr(tokenizer, "deprecation_warnings", None), dict):
        warned[_LONG_SEQUENCE_WARNING] = True
    return model.to(device), tokenizer


def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the model a ``model`` argument names (as :func:`load_model` takes it),
    without its weights: to count tokens as that model will, e.g. for an agent's history
    budget. Raises :class:`~voltrl.errors.VoltRLError` when it cannot be loaded."""
    from transformers import AutoTokenizer

    if model == TINY:
        return build_tiny_tokenizer()
    if isinstance(model, str) and model in PACKAGED_MODELS:
        model = fetch_model(model)
    path = Path(model).expanduser()
    local = path.exists()
    if not local and not _hub_name(model):
        raise VoltRLError(f"cannot load the tokenizer of {model}: the directory does not exist")
    unreachable = None if local else _hub_unreachable()
    try:  # a hub name: from the cache alone when the hub cannot be reached
        return AutoTokenizer.from_pretrained(
            str(path if local else model), local_files_only=bool(unreachable)
        )
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        if unreachable:
            reason = f"it is not in the Hugging Face cache, and {unreachable}"
        raise VoltRLError(f"cannot load the tokenizer of {model}: {reason}") from None


_LONG_SEQUENCE_WARNING = "sequence-length-is-longer-than-the-specified-maximum"
"""The key under which a transformers tokenizer remembers it gave the warning that a
tokenized text is longer than its ``model_max_length``."""


def _from_pretrained(
    model: str | Path, tokenizer: PreTrainedTokenizerBase | None, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """:func:`load_model` for a path or hub name (see there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, path = str(model), Path(model).expanduser()
    local = path.exists()
    unreachable = None
    if not local:
        if not _hub_name(model):
            raise VoltRLError(
                f"cannot load a model from {name}: the directory {name} does not exist"
            )
        unreachable = _hub_unreachable()
    # from the cache alone when the hub cannot be reached (the adapter lookup takes its own
    # flag, else it retries the hub for a minute)
    hub: dict[str, Any] = (
        {"local_files_only": True, "adapter_kwargs": {"local_files_only": True}}
        if unreachable
        else {}
    )
    source = str(path) if local else name
    try:
        with quiet_transformers():
            loaded = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **hub)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(
            source, local_files_only=bool(unreachable)
        )
    except (OSError, ValueError) as exc:
        if unreachable:
            raise VoltRLError(
                f"cannot load a model from {name}: it is not a local directory, the Hugging "
                f"Face cache does not hold it, and {unreachable}; pass a local directory "
                'holding the model, "tiny", or a packaged model (voltrl model list)'
            ) from None
        reason = " ".join(str(exc).split())
        raise VoltRLError(f"cannot load a model from {name}: {reason}") from None
    return loaded, tokenizer


def _hub_name(model: str | Path) -> bool:
    """Whether ``model`` reads as a Hugging Face hub name (a ``Path`` always names a
    directory)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(str(model))
    except HFValidationError:
        return False
    return not isinstance(model, Path)


def _hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached (offline mode is set, or a TCP connection
    to its endpoint, or to the proxy the environment names for it, fails within
    ``timeout_s``), or ``None`` when it can: checked before a download, which would
    otherwise retry for about a minute."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "the hub is offline (HF_HUB_OFFLINE is set)"
    url = urlsplit(constants.ENDPOINT)
    via = ""
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        via = f" through the proxy {url.hostname}"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError as exc:
        return f"the hub at {constants.ENDPOINT} cannot be reached{via} ({exc.strerror or exc})"
    return None


def model_name(model: object) -> str:
    """How a run records ``model``: a local directory as its absolute path (so a resume from
    another directory, or from the run's ``train.yaml``, names the same model), a name as
    given, a model object by its class name."""
    if isinstance(model, str | Path):
        path = Path(model).expanduser()
        return str(path.resolve()) if path.exists() else str(model)
    return type(model).__name__
