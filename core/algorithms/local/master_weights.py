"""How a model in half precision is trained without losing its small updates.

A half-precision weight cannot hold an AdamW step of ``lr * update`` smaller than its own
rounding step (bfloat16 keeps 8 bits of mantissa: a weight of 1.0 moves in steps of 1/128),
so most small updates would vanish. :class:`MasterWeights` keeps a float32 copy of each
trainable half-precision tensor: the optimizer (and its state) works on those, and each step
copies them back into the model. This is mixed-precision training's classic answer; an
optimizer with stochastic rounding would save the copies' memory but changes the update's
maths, and LoRA, the usual way to fit a large model, trains adapters that peft keeps in
float32 anyway (its ``autocast_adapter_dtype``), so the copies there are small or none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class MasterWeights:
    """Float32 copies of the half-precision tensors among ``params`` (see the module
    docstring). Give the optimizer :attr:`optimized`; after the optimizer step call
    :meth:`masters_to_params`. Each backward pass adds a half-precision tensor's gradient to
    its master's in float32 at once (a hook on the tensor), so micro-batches accumulate in
    float32 and the tensor keeps no gradient of its own; :meth:`close` removes the hooks.
    With only float32 tensors it does nothing and :attr:`optimized` is ``params`` itself."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        import torch

        self.params = list(params)
        self.low = [i for i, p in enumerate(self.params) if p.dtype != torch.float32]
        self.masters: dict[int, torch.Tensor] = {
            i: self.params[i].detach().float().clone().requires_grad_(True) for i in self.low
        }
        self.optimized = [self.masters.get(i, p) for i, p in enumerate(self.params)]
        self._hooks = [
            self.params[i].register_post_accumulate_grad_hook(self._to_master(i)) for i in self.low
        ]

    def _to_master(self, i: int) -> Any:
        master = self.masters[i]

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            grad = param.grad.float()
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            param.grad = None

        return hook

    def close(self) -> None:
        """Stop moving gradients (another optimizer will train these tensors)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def masters_to_params(self) -> None:
        """Copy the stepped master weights back into the model (rounded to its dtype)."""
        for i, master in self.masters.items():
            self.params[i].data.copy_(master.data)

    def params_to_masters(self) -> None:
        """Take the model's weights into the masters again (after loading weights into it
        from a checkpoint that saved no masters)."""
        for i, master in self.masters.items():
            master.data.copy_(self.params[i].data)

    def take_float32(self, tensors: Mapping[int, torch.Tensor | None]) -> None:
        """Set the masters, by position among ``params``, to those of ``tensors`` that are
        float32 (a float32 checkpoint's exact values); the others are left as they are."""
        import torch

        for i, tensor in tensors.items():
            if tensor is not None and tensor.dtype == torch.float32:
                self.masters[i].data.copy_(tensor)

    def state_dict(self) -> dict[int, torch.Tensor]:
        """The master copies, by position among ``params`` (what a checkpoint saves)."""
        return {i: m.detach() for i, m in self.masters.items()}

    def load_state_dict(self, state: dict[int, torch.Tensor]) -> None:
        """Restore the master copies saved by :meth:`state_dict`. A model now in float32
        (the run resumed with ``dtype="float32"``) takes them as its weights, exactly."""
        if not self.masters:
            for i, tensor in state.items():
                self.params[i].data.copy_(tensor)
            return
        if set(state) != set(self.masters):
            raise ValueError("the checkpoint's master weights do not match this model's")
        for i, master in self.masters.items():
            master.data.copy_(state[i])
