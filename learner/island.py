"""An island: the ranks of one learner, training data-parallel (torchrun, DDP).

    torchrun --standalone --nproc-per-node 2 -m learner.main --server HOST:PORT --learner-id a

Inner steps are data-parallel across the ranks (DistributedDataParallel: gloo on the CPU,
nccl on GPUs), so every rank holds the same parameters and optimizer state after each step.
Towards the aggregator the island is ONE learner, and only rank 0 talks to it: it joins,
pushes the island's pseudo-gradients (with the tokens of all ranks), pulls and merges, then
broadcasts the merged parameters to the other ranks over the island's fast network.

Why rank 0 alone rather than each rank carrying its share of the fragments: the ranks'
parameters are identical, so there is exactly one pseudo-gradient per fragment to send
whoever sends it; one connection per island keeps the server's view (one session, one lease,
one token, one contribution per round) the same as for a single-process learner; and the
intra-island broadcast costs little next to a WAN transfer. Sharing fragments across ranks
would spread the encode/decode CPU work, at the price of N sessions that must fail and
rejoin together. The cost of this choice: rank 0 alone quantizes and may wait at a merge,
and the other ranks wait with it at the next collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

LEADER = 0


def restart_safe_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store a torchrun worker's process group should meet in: torchrun's own, with a
    prefix for this restart attempt; None outside torchrun's agent store.

    Why: with --max-restarts, the workers started again after a rank died meet in the store
    that outlived them, and (torch 2.13, --standalone, gloo) read the dead workers' addresses
    from it: "Gloo connectFullMesh failed ... Connection refused", and the island never comes
    back. Each attempt's keys under their own prefix keep them apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"diloco/attempt_{attempt}", store)


class Island:
    """Rank, size and the few collectives the learner needs (no-ops for a single process)."""

    def __init__(
        self, rank: int = 0, world_size: int = 1, local_rank: int = 0, local_size: int = 1
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_size = local_rank, local_size
        self.device = torch.device("cpu")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Island:
        """The island torchrun describes in RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE;
        a single process when they are absent."""
        try:
            return cls(
                rank=int(environ.get("RANK", "0")),
                world_size=int(environ.get("WORLD_SIZE", "1")),
                local_rank=int(environ.get("LOCAL_RANK", "0")),
                local_size=int(environ.get("LOCAL_WORLD_SIZE", "1")),
            )
        except ValueError as err:
            raise ValueError(
                f"torchrun's RANK/WORLD_SIZE variables are not integers: {err}"
            ) from err

    @property
    def is_leader(self) -> bool:
        return self.rank == LEADER

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def start(self, device: torch.device, timeout_s: float = 1800.0) -> torch.device:
        """Join the island's process group; returns this rank's device (cuda:LOCAL_RANK on
        GPUs, with nccl; the CPU with gloo)."""
        if device.type == "cuda" and self.distributed:
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        if self.distributed and not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            timeout = datetime.timedelta(seconds=timeout_s)
            store = restart_safe_store(self.world_size, timeout)
            if store is None:
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=timeout,
                )
        return device

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to run forward/backward on: DDP across the ranks, or the model itself."""
        if not self.distributed:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def agree(self, values: Sequence[int]) -> list[int]:
        """Rank 0's values, on every rank (the island follows its leader's decisions)."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        dist.broadcast(tensor, LEADER)
        return tensor.tolist()

    def broadcast_params(self, params: Sequence[torch.Tensor]) -> None:
        """Overwrite every rank's parameters with rank 0's (after a merge), in one message."""
        if not self.distributed:
            return
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, LEADER)
            if not self.is_leader:
                offset = 0
                for p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable object on every rank (a checkpoint's optimizer state)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, LEADER, device=self.device)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order (on every rank)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def close(self, finished: bool = True) -> None:
        """Leave the process group. `finished`: every rank ended its run normally."""
        if self.distributed and dist.is_initialized():
            # After a normal end, every rank waits here before any tears its connections
            # down: a gloo peer that loses its connection mid-shutdown aborts ("terminate
            # called without an active exception", seen in CI), failing the island. After an
            # error the other ranks may be inside a collective: no barrier, torchrun ends them.
            try:
                if finished:
                    dist.barrier()
            finally:
                dist.destroy_process_group()


def exit_without_teardown() -> None:
    """End an island's rank once its work is done and written (after close()), without the
    interpreter's teardown. Now and then a rank aborted after a finished run, past the
    barrier and the process group's destruction ("terminate called without an active
    exception", SIGABRT), which failed the whole island under torchrun. Gloo's threads can
    outlive the group's destruction holding tensors, and freeing those while the interpreter
    finalizes is a known way to abort; with nothing left to do, the rank skips that teardown."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:  # a closed pipe must not send the rank back into that teardown
        os._exit(0)
