"""Which verl versions VoltRL supports, and the check every verl-using entry point runs first.

The integration uses verl's 0.9 extension points (the v1 trainer with TransferQueue, its
agent-loop manager contract, custom dataset classes); 0.8 and older lack them and 0.10 may
change them, so other versions are refused with a clear message instead of failing deep
inside verl.
"""

from __future__ import annotations

from importlib import metadata

from voltrl.errors import VoltRLError

SUPPORTED_VERL = ">=0.9.0,<0.10"
"""The verl versions this integration is written and tested against (tested: 0.9.1)."""

_MIN = (0, 9)
_MAX_EXCLUSIVE = (0, 10)


class VerlUnavailableError(VoltRLError, ImportError):
    """verl is not installed, or is a version VoltRL does not support."""


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits or digits != piece:
            if digits:
                parts.append(int(digits))
            break
        parts.append(int(digits))
    return tuple(parts)


def check_version(version: str) -> None:
    """Raise :class:`VerlUnavailableError` unless ``version`` is in :data:`SUPPORTED_VERL`."""
    release = _release(version)
    if not (_MIN <= release[:2] < _MAX_EXCLUSIVE):
        raise VerlUnavailableError(
            f"verl {version} is installed, but VoltRL's VERL algorithm supports verl "
            f"{SUPPORTED_VERL} (tested with 0.9.1): pip install 'voltrl[verl]'"
        )


def require_verl() -> str:
    """Check that a supported verl is importable; returns its version."""
    try:
        version = metadata.version("verl")
    except metadata.PackageNotFoundError:
        raise VerlUnavailableError(
            f"vl.VERL needs verl {SUPPORTED_VERL}, which is not installed: "
            "pip install 'voltrl[verl]' (plus vLLM and a CUDA torch on the GPU machines)"
        ) from None
    check_version(version)
    return version
