"""A run's tokenizer: where LocalRL saves it in the run directory, and loading it from there.

``voltrl audit``, the dashboard and ``voltrl show`` decode (and re-render) a run's token ids with
the tokenizer LocalRL saved at setup (``<run dir>/tokenizer``), or the one saved with the final
model (``<run dir>/final``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from voltrl.errors import VoltRLError

TOKENIZER_DIR = "tokenizer"
"""``<run dir>/tokenizer``: the run's tokenizer, saved at setup for tools that decode its ids."""
FINAL_DIR = "final"
"""``<run dir>/final``: the trained model, with its tokenizer, saved at the end of a run."""
TOKENIZER_DIRS = (TOKENIZER_DIR, FINAL_DIR)
"""Where a run's tokenizer may be, in the order they are tried."""


def saved_tokenizer(run_dir: Path | None) -> Path | None:
    """The directory holding the tokenizer saved in ``run_dir``, or None."""
    if run_dir is None:
        return None
    for name in TOKENIZER_DIRS:
        path = run_dir / name
        if (path / "tokenizer_config.json").exists():
            return path
    return None


def load_saved_tokenizer(path: Path) -> Any:
    """The tokenizer saved at ``path`` (no download); raises :class:`VoltRLError` when
    transformers is missing or the files do not load."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise VoltRLError(
            "reading a run's tokenizer needs transformers (pip install 'voltrl[local]')"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise VoltRLError(f"cannot load the tokenizer in {path}: {exc}") from None
