"""The outer optimizer: SGD with Nesterov momentum, applied to averaged pseudo-gradients.

DiLoCo treats the mean pseudo-gradient Δ = θ_global − θ_local as a gradient and takes one
step of torch.optim.SGD(lr, momentum, nesterov=True, dampening=0). This module reproduces
that update operation for operation (so results are bit-identical to torch's), while keeping
the state explicit and per fragment so it can be saved, restored and sharded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class NesterovOuter:
    """Momentum buffers for one fragment's tensors; `step` updates params in place."""

    lr: float = 0.7
    momentum: float = 0.9
    momentum_buffers: list[torch.Tensor] | None = field(default=None)

    def update(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Advance the momentum and return the Nesterov update −lr·(g + momentum·buf).

        Used with quantized pulls, where the server adds a quantized copy of this update.
        """
        buffers = self._advance_momentum(grads)
        return [
            g.add(buf, alpha=self.momentum).mul_(-self.lr)
            for g, buf in zip(grads, buffers, strict=True)
        ]

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """One torch.optim.SGD(nesterov=True) step of `params` along `grads`."""
        buffers = self._advance_momentum(grads)
        for p, g, buf in zip(params, grads, buffers, strict=True):
            p.add_(g.add(buf, alpha=self.momentum), alpha=-self.lr)

    def _advance_momentum(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.momentum_buffers is None:
            # torch starts the buffer as a copy of the first gradient.
            self.momentum_buffers = [g.detach().clone() for g in grads]
        else:
            for buf, g in zip(self.momentum_buffers, grads, strict=True):
                buf.mul_(self.momentum).add_(g)
        return self.momentum_buffers
