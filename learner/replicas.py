"""The global fragments a join brings in: offered, continued from a checkpoint, or pulled.

    replicas, kept = ReplicaLoader(client, transport, params, learner_id).load(
        session_id, join_reply.fragments, resume)

For each fragment the server lists at Join: if the run has no value for it yet (version
< 0), this learner offers its own parameters as the initial one (the first offer wins; any
later one is answered ALREADY_EXISTS). Then, for a fragment a checkpoint saved (`resume`),
only the updates since the saved version are pulled, and if the run has not moved it
meanwhile the learner keeps its local parameters for it (`kept`), so no inner step since the
last push is lost. Every other fragment, or one the server cannot continue, comes as a
snapshot. A fragment whose shard was away at the join (`away`) is neither offered nor
pulled: its replica stands in as the checkpoint saved it, or else as the local parameters at
version -1, and the learner keeps its local parameters for it until that shard is joined
(learner/rejoin.py), which loads the fragment as above. A shard's rejoin after a restart
(learner/rejoin.py) loads its fragments here too, the replicas the learner holds standing
for `resume`: where the shard lost versions (it is behind the replica) or holds another
history, the fragment takes the shard's state and drops its local progress, one log line
per load naming each such fragment and why. Nothing here retries: a shard gone again fails
the load, and the rejoin backs off and tries later.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
import torch

from common.codec.fragment import encode_fragment, params_crc32
from common.codec.slices import SliceCut, is_sliced
from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.client import AggregatorClient
from learner.progress import SavedReplica
from learner.streaming import FragmentReplica
from learner.transport import GrpcTransport

log = logging.getLogger("diloco.learner")


class ReplicaLoader:
    """Fills a joining learner's replicas of the global fragments."""

    def __init__(
        self,
        client: AggregatorClient,
        transport: GrpcTransport,
        params: Sequence[torch.Tensor],
        learner_id: str,
        full_shapes: Sequence[tuple[int, ...]] = (),
        slice_of: tuple[int, int] = (0, 0),
        carries: bool = True,
    ) -> None:
        """A rank of a sharded island (learner/sliced.py): `params` are its slices (index,
        count) = `slice_of` of parameters shaped `full_shapes`; with `carries` False (HSDP's
        replicas but the first) it neither offers nor pulls, replica 0 fills its replicas."""
        self.client, self.transport = client, transport
        self.params, self.learner_id = params, learner_id
        self.full_shapes, self.slice_of, self.carries = list(full_shapes), slice_of, carries

    def load(
        self,
        session_id: str,
        fragments: Sequence[pb.FragmentLayout],
        resume: list[SavedReplica] | None,
        away: frozenset[int] | set[int] = frozenset(),
    ) -> tuple[list[FragmentReplica], set[int]]:
        """(a replica per fragment at the run's version, the fragments whose local
        parameters are still current and must be kept); the fragments in `away` are
        neither offered nor pulled (their shard did not answer the join)."""
        saved = {(r.fragment_id, tuple(r.indices)): r for r in resume or []}
        replicas, kept, resynced = [], set(), []
        for f in fragments:
            replica = FragmentReplica(
                f.fragment_id,
                list(f.param_indices),
                [tuple(self.params[i].shape) for i in f.param_indices],
                self._cut(f.param_indices),
            )
            if not self.carries:  # HSDP's other replicas: replica 0 fills it
                replicas.append(replica)
                continue
            mine = saved.get((f.fragment_id, tuple(f.param_indices)))
            if f.fragment_id in away:
                self._stand_in(replica, mine)
                kept.add(f.fragment_id)
                replicas.append(replica)
                continue
            if f.version < 0:
                self._offer_initial_params(session_id, replica)
            why = None if mine is None else self._not_continued(replica, mine)
            if why is not None:
                resynced.append(why)
            if mine is not None and why is None:
                if replica.version == mine.version:
                    kept.add(f.fragment_id)  # nobody moved it: keep the local progress
            else:
                replica.apply(self.transport.pull(replica.fragment_id, -1, 0, retry=False))
            replicas.append(replica)
        if resynced:
            log.warning(
                "learner=%s resyncing to the server's state, local progress dropped: %s",
                self.learner_id,
                "; ".join(resynced),
            )
        return replicas, kept

    def _cut(self, indices: Sequence[int]) -> SliceCut | None:
        """The slice of the fragment this rank holds; None for whole parameters."""
        index, count = self.slice_of
        if not is_sliced(count):
            return None
        return SliceCut([self.full_shapes[i] for i in indices], index, count)

    def _stand_in(self, replica: FragmentReplica, saved: SavedReplica | None) -> None:
        """Fill the replica of a fragment whose shard is away: as saved, or else the local
        parameters at version -1 (its shard's join then pulls a snapshot)."""
        if saved is not None:
            replica.params, replica.version = [p.clone() for p in saved.params], saved.version
        else:
            replica.params = [
                self.params[i].detach().to("cpu", torch.float32, copy=True) for i in replica.indices
            ]
        log.info(
            "learner=%s fragment %d: its shard is away; training on the local parameters",
            self.learner_id,
            replica.fragment_id,
        )

    def _not_continued(self, replica: FragmentReplica, saved: SavedReplica) -> str | None:
        """Bring a saved replica up to date with the updates since its version; None if
        that worked, else why the server cannot continue it (its state is not a
        continuation of ours)."""
        replica.params, replica.version = [p.clone() for p in saved.params], saved.version
        reply = self.transport.pull(replica.fragment_id, saved.version, 0, retry=False)
        try:
            replica.apply(reply)
        except RuntimeError as err:  # the checksum after the update chain does not match
            return f"{err} (the server holds another history)"
        where = f"fragment {replica.fragment_id}: server at version {reply.version}"
        if reply.version < saved.version:
            return f"{where} is behind our {saved.version} (the server lost versions)"
        if reply.version != replica.version or reply.params_crc32 != params_crc32(replica.params):
            return f"{where}, ours at {saved.version} (the server holds another history)"
        return None

    def _offer_initial_params(self, session_id: str, replica: FragmentReplica) -> None:
        header = pb.PushHeader(
            session_id=session_id,
            fragment_id=replica.fragment_id,
            base_version=-1,
            kind=pb.PUSH_KIND_INITIAL,
            slice_index=self.slice_of[0],
            slice_count=self.slice_of[1],
        )
        local = [self.params[i].detach() for i in replica.indices]
        try:
            self.client.push(header, encode_fragment(local, "fp32"))
            log.info("learner=%s initialized fragment %d", self.learner_id, replica.fragment_id)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise  # otherwise another learner was first: fine, we pull theirs
