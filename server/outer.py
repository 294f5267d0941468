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

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """One torch.optim.SGD(nesterov=True) step of `params` along `grads`."""
        lr, momentum = self.lr, self.momentum
        if self.momentum_buffers is None:
            # torch starts the buffer as a copy of the first gradient.
            self.momentum_buffers = [g.detach().clone() for g in grads]
        else:
            for buf, g in zip(self.momentum_buffers, grads, strict=True):
                buf.mul_(momentum).add_(g)
        for p, g, buf in zip(params, grads, self.momentum_buffers, strict=True):
            p.add_(g.add(buf, alpha=momentum), alpha=-lr)
