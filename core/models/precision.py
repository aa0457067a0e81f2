"""The precision LocalRL, SFT and ``voltrl model serve`` load a model in.

``dtype="auto"`` (the default) is bfloat16 on a CUDA device that supports it and float32
elsewhere: on a CPU, bfloat16 matmuls are no faster here and lose precision. Logprobs are
always taken in float32 from the logits (the engine's and the update's alike). How a model in
half precision is trained without losing its small updates:
:mod:`voltrl.algorithms.local.master_weights`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""The names a ``dtype`` argument takes (this module imports torch only when it is used, so
that ``LocalRL`` checks one without it)."""


def checked_dtype(dtype: str, training: bool = False) -> str:
    """``dtype`` when it is one of :data:`DTYPES`; else ``ValueError`` naming them. For
    ``training``, float16 is refused too: small gradients underflow in it without loss
    scaling, which LocalRL and SFT do not do (bfloat16 has float32's range)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if training and dtype == "float16":
        raise ValueError(
            "dtype='float16' cannot train here (gradients underflow without loss scaling): "
            "use 'bfloat16' (voltrl model serve takes float16)"
        )
    return dtype


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """The torch dtype ``dtype`` names on ``device`` (see the module docstring for
    ``auto``). Raises ``ValueError`` for another name."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        cuda = torch.device(device).type == "cuda"
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    return getattr(torch, checked_dtype(dtype))
