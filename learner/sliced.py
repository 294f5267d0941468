"""An island whose ranks each hold a slice of the model (FSDP2, or HSDP): every rank syncs
its own slice, and towards the aggregator the island is one learner.

    model = MyModel()
    for block in model.blocks:
        fully_shard(block)                  # torch.distributed.fsdp, under torchrun
    fully_shard(model)
    with DilocoSync(model, server=..., learner_id="island-a", tokens_per_step=B * T) as sync:
        ...                                 # every rank calls sync.step() after each step

DilocoSync finds the parameters are DTensors sharded on their first dimension and takes
this path (learner/api.py). Each rank's slice of a fragment is its FSDP shard (rows of dim
0, common/codec/slices.py), so nothing is gathered: rank r quantizes and pushes the
pseudo-gradient of its own rows and pulls its own rows back, on its own connection, and the
island's WAN bandwidth is the sum of its ranks'. The anchor copy (the replica of the global
slice) and the error-feedback residuals are slices too: each rank holds 1/R of them.

One learner to the server: rank 0 joins (and heartbeats) and hands the session to the other
ranks; every rank pushes its slice in that session, and the server counts the island's
pseudo-gradient once every slice has arrived (server/rounds/slices.py): one token claim (the
island's: every rank's tokens), one weight, one quorum member. A rank whose slice is not the
last one learns nothing about the round from its push, so at every merge the ranks agree
on the version to take (the newest any of them pulled; the others pull up to it), and in
quorum and async modes on when to merge (when every rank's sync is back), so the island's
slices always hold one version: bit for bit the server's, with a CRC per slice.

HSDP (a 2-D mesh, Replicate x Shard(0)): the shard groups of replica 0 carry the slices; the
other replicas hold the same rows, so they push nothing and take the merged replica from
replica 0 over the island's network (a broadcast in their replicate group).

Failure: a rank that dies ends the island (torchrun stops every rank and, with
--max-restarts, starts them again; the island then joins as the same learner). A server that
lost the session is noticed by all ranks together, at the next push or merge, and ends the
island the same way (IslandRestart), rather than half of it rejoining. The slices of a dead
island's last push never count (the server holds incomplete sets aside).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.island import Island
from learner.shard_sessions import SessionLost
from learner.streaming import FragmentReplica, PullReply

if TYPE_CHECKING:
    from learner.shards import ShardedClient


class IslandRestart(RuntimeError):
    """A server lost the island's session: every rank raises this at the same point, and
    the island is started again (torchrun --max-restarts) to join again."""


def shard_model(
    model: nn.Module, blocks: Sequence[nn.Module], replicas: int, device: torch.device
) -> None:
    """fully_shard each of `blocks` (a transformer's layers), then the whole model, over
    every rank: FSDP2, or HSDP on a (replicas x shards) mesh when `replicas` > 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if replicas > 1:
        if world % replicas:
            raise ValueError(f"{replicas} HSDP replicas do not divide the island's {world} ranks")
        shape, names = (replicas, world // replicas), ("replicate", "shard")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    else:
        mesh = init_device_mesh(device.type, (world,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def is_sharded(params: Sequence[nn.Parameter]) -> bool:
    """Whether the parameters are DTensors (a model wrapped with fully_shard)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def local(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds: a DTensor's local shard, else itself."""
    to_local = getattr(param, "to_local", None)
    return to_local().detach() if to_local is not None else param


class LocalSlices(Sequence[torch.Tensor]):
    """Each DTensor parameter's local shard, looked up at every use: FSDP2 may give a
    parameter new local storage at its lazy initialisation (the first forward)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self._params = list(params)

    def __len__(self) -> int:
        return len(self._params)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return local(self._params[i])


class ShardedIsland:
    """This rank's place in a sharded island and the collectives its syncs agree with."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not dist.is_initialized():
            raise ValueError("a sharded model needs torch.distributed initialised (torchrun)")
        first = params[0]
        if not all(isinstance(p, DTensor) for p in params):
            raise ValueError(
                "some parameters are DTensors and some are not: shard the whole model "
                "(call fully_shard on the root module too)"
            )
        mesh, placements = first.device_mesh, tuple(first.placements)
        for p in params:
            if p.device_mesh != mesh or tuple(p.placements) != placements:
                raise ValueError("every parameter must be sharded on one mesh the same way")
        shard_dims = [d for d, pl in enumerate(placements) if pl == Shard(0)]
        replicate_dims = [d for d, pl in enumerate(placements) if pl == Replicate()]
        if len(shard_dims) != 1 or len(shard_dims) + len(replicate_dims) != len(placements):
            raise ValueError(
                f"parameters placed as {placements}: an island syncs FSDP2 (Shard(0)) or "
                "HSDP (Replicate(), Shard(0)) models"
            )
        if len(replicate_dims) > 1:
            raise ValueError(f"parameters placed as {placements}: one replicate dimension at most")
        shard_dim = shard_dims[0]
        self.index, self.count = mesh.get_local_rank(shard_dim), mesh.size(shard_dim)
        self.replica, self.replicas, self._replicate_group = 0, 1, None
        if replicate_dims:
            dim = replicate_dims[0]
            self.replica, self.replicas = mesh.get_local_rank(dim), mesh.size(dim)
            self._replicate_group = mesh.get_group(dim)
        # The island's ranks as a whole: the collectives a DDP island uses too.
        self.ranks = Island(dist.get_rank(), dist.get_world_size())
        self.rank, self.world_size = self.ranks.rank, self.ranks.world_size
        self.device = self.ranks.device = first.to_local().device
        for p in params:
            if p.dim() == 0:
                raise ValueError("a 0-dimensional parameter cannot be sliced: make it 1-D")

    def describe(self) -> str:
        """How the island is cut, for the join's log line."""
        hsdp = f" x {self.replicas} replicas (HSDP)" if self.replicas > 1 else ""
        return f" island_ranks={self.world_size} slices={self.count}{hsdp}"

    @property
    def is_leader(self) -> bool:
        return self.ranks.is_leader

    @property
    def carries(self) -> bool:
        """Whether this rank pushes and pulls its slice (HSDP: replica 0's ranks only)."""
        return self.replica == 0

    @property
    def slice_of(self) -> tuple[int, int]:
        return self.index, self.count

    def leader_value(self, value: int) -> int:
        """Rank 0's integer, on every rank (a decision the leader takes from its heartbeats)."""
        return self.ranks.agree([value])[0]

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""
        tensor = torch.tensor([0 if flag else 1], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, dist.ReduceOp.MAX)
        return int(tensor.item()) == 0

    def share_join(
        self, client: ShardedClient, join: Callable[[], object], learner_id: str
    ) -> pb.JoinResponse:
        """The leader joins (`join()`, into `client`) and every rank takes the session it
        got, one learner to the server; returns the join's reply, on every rank."""
        replies = None
        if self.is_leader:
            join()
            replies = [r.SerializeToString() if r else None for r in client.last_join]
        replies = self.ranks.broadcast_object(replies)
        joined = [pb.JoinResponse.FromString(r) if r else None for r in replies]
        return client.adopt(joined, learner_id)

    def settle_joined(
        self,
        replicas: Sequence[FragmentReplica],
        kept: set[int],
        pull: Callable[[int, int, int], PullReply],
    ) -> set[int]:
        """After a join: every rank's replicas at one version per fragment (settle; `pull`
        is the transport's: fragment, have, wait-for). Returns the fragments whose local
        slices the island keeps: those every rank kept and none had to catch up on, so
        that no fragment is half kept, half the server's."""
        agreed = set()
        for replica in replicas:
            before = replica.version
            self.settle(replica, False, lambda v, r=replica: pull(r.fragment_id, r.version, v))
            if self.all_true(replica.fragment_id in kept and replica.version == before):
                agreed.add(replica.fragment_id)
        return agreed

    def check_joined(self, lost: bool) -> None:
        """Raise IslandRestart on every rank if a server lost the session on any rank."""
        self._raise_if_lost(not self.all_true(not lost))

    @staticmethod
    def _raise_if_lost(any_lost: bool) -> None:
        if any_lost:
            raise IslandRestart(
                "a server no longer knows the island's session (restarted, or the lease "
                "ran out): the island restarts to join again (run it with torchrun "
                "--max-restarts)"
            )

    def settle(
        self, replica: FragmentReplica, lost: bool, pull: Callable[[int], PullReply]
    ) -> None:
        """Bring every rank's replica of the fragment to one version: the newest any
        carrying rank holds (the others pull their slice up to it; HSDP's other replicas
        take replica 0's). Raises IslandRestart if any rank's sync lost its session."""
        while True:  # one collective a round: check_joined's flag beside the versions
            version = replica.version if self.carries else -1
            low = version if self.carries else 1 << 62
            tensor = torch.tensor([int(lost), -low, version], dtype=torch.int64, device=self.device)
            dist.all_reduce(tensor, dist.ReduceOp.MAX)
            self._raise_if_lost(int(tensor[0]) == 1)
            low, high = -int(tensor[1]), int(tensor[2])
            if low == high:
                break
            if self.carries and replica.version < high:
                try:
                    replica.apply(pull(high))
                except SessionLost:  # the next round tells every rank, and all raise together
                    lost = True
        if self.replicas > 1:
            self._from_replica_zero(replica, high)

    def _from_replica_zero(self, replica: FragmentReplica, version: int) -> None:
        """Replica 0's slice values in this rank's replica (HSDP), in one message."""
        numels = [int(torch.Size(s).numel()) for s in replica.shapes]
        if self.carries:
            flat = torch.cat([p.reshape(-1) for p in replica.params]).to(self.device)
        else:
            flat = torch.empty(sum(numels), dtype=torch.float32, device=self.device)
        source = dist.get_global_rank(self._replicate_group, 0)
        dist.broadcast(flat, source, group=self._replicate_group)
        if not self.carries:
            parts = flat.cpu().split(numels)
            replica.params = [
                part.view(shape).clone() for part, shape in zip(parts, replica.shapes, strict=True)
            ]
            replica.version = version
