"""Fragment syncs over gRPC on a background thread, so training continues while they travel.

One worker thread runs syncs in the order they were started: push the pseudo-gradient, then
long-poll PullParams until the round it joined has closed. The training loop collects the
result at the merge point (StreamingSync.merge_phase) and only waits if it is not back yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.client import AggregatorClient
from learner.streaming import PullReply

log = logging.getLogger("diloco.learner")

PULL_WAIT_S = 20.0


class GrpcTransport:
    def __init__(self, client: AggregatorClient, session_id: Callable[[], str]) -> None:
        self.client = client
        self.session_id = session_id
        self.stale_pushes = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sync")

    def start_sync(
        self, fragment_id: int, base_version: int, payload: bytes, tokens: int, inner_steps: int
    ) -> Future[PullReply]:
        return self._worker.submit(
            self._sync, fragment_id, base_version, payload, tokens, inner_steps
        )

    def finish_sync(self, handle: Future[PullReply]) -> PullReply:
        return handle.result()

    def ready(self, handle: Future[PullReply]) -> bool:
        return handle.done()

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)

    def pull(self, fragment_id: int, have_version: int, wait_for_version: int) -> PullReply:
        """Long-poll until the fragment reaches `wait_for_version`; returns what to apply."""
        while True:
            header, payload = self.client.pull(
                self.session_id(), fragment_id, have_version, wait_for_version, PULL_WAIT_S
            )
            if header.version >= wait_for_version:
                return PullReply(header.kind, header.version, payload, header.params_crc32)

    def _sync(
        self, fragment_id: int, base_version: int, payload: bytes, tokens: int, inner_steps: int
    ) -> PullReply:
        header = pb.PushHeader(
            session_id=self.session_id(),
            fragment_id=fragment_id,
            base_version=base_version,
            tokens=tokens,
            inner_steps=inner_steps,
            kind=pb.PUSH_KIND_DELTA,
        )
        try:
            target = self.client.push(header, payload).round_version
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # Stale: the round closed without us. This update is lost; take the new state.
            self.stale_pushes += 1
            log.warning("fragment=%d push rejected: %s", fragment_id, err.details())
            target = base_version + 1
        return self.pull(fragment_id, base_version, target)
