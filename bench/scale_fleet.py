"""The simulated learners of bench/scale.py: threads that push pre-encoded fragments to
their owning shards, wait for each round, pull its update, and a probe that times pulls.

    fleet = Fleet(addresses, Model(side=2048), learners=8)
    owned = fleet.join_all(initial)                   # per shard, the fragments it owns
    threading.Thread(target=fleet.push_loop, args=(i, owned[s], pushes)).start()
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc

from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import Stopped, call_with_retry
from common.rpc import LEARNER_ID_HEADER
from learner.shards import ShardedClient

FRAGMENTS = 4
TENSORS = 8  # two per fragment
# Pull answers held at once in this process (Fleet.pulls).
PULLS_AT_ONCE = 16


@dataclass(frozen=True)
class Model:
    """TENSORS square fp32 matrices of `side` x `side`, two per fragment."""

    side: int

    @property
    def specs(self) -> list[pb.ParamSpec]:
        shape = [self.side, self.side]
        return [pb.ParamSpec(name=f"w{i}", shape=shape, dtype="float32") for i in range(TENSORS)]

    @property
    def params(self) -> int:
        return TENSORS * self.side * self.side


class Fleet:
    """The simulated learners of one run and what they measured."""

    def __init__(self, addresses: list[str], model: Model, learners: int) -> None:
        self.addresses, self.model, self.learners = addresses, model, learners
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.pushes = 0
        self.pull_latencies: list[float] = []
        # (start, end) of each accepted push (retries included), on time.perf_counter's clock:
        # bench/snapshots.py sorts them by what the server was doing.
        self.push_spans: list[tuple[float, float]] = []
        self.pull_spans: list[tuple[float, float]] = []  # the probe's, likewise
        self.closes: list[float] = []  # when the watchers saw each new version, likewise
        self.errors: dict[str, int] = {}
        self.error_details: dict[str, str] = {}  # the first message of each code
        self.retried: dict[str, int] = {}  # pushes tried again, by the status that refused them
        self.sessions: list[str] = []
        self.clients: list[ShardedClient] = []
        self.latest = [0] * FRAGMENTS  # the newest version of each fragment (watch_loop)
        self.advanced = threading.Condition(self.lock)
        # Pull answers held at once in this process: 64 learners x 4 shards taking a 71 MB
        # update each at the same moment would hold gigabytes here, not in the servers.
        self.pulls = threading.BoundedSemaphore(PULLS_AT_ONCE)

    def client(self, i: int) -> ShardedClient:
        return ShardedClient(self.addresses, None, ((LEARNER_ID_HEADER, f"scale-{i}"),))

    def join_all(self, initial: list[bytes]) -> list[list[int]]:
        """Join every learner on every shard; learner 0 initialises each fragment. Returns
        the owner shard's fragments, per shard."""
        for i in range(self.learners + 1):  # the last: the probe, a learner that never pushes
            client = self.client(i)
            client.wait_ready(60)
            reply = client.join(f"scale-{i}", self.model.specs)
            self.clients.append(client)
            self.sessions.append(reply.session_id)
            if i == 0:
                for f in range(FRAGMENTS):
                    header = pb.PushHeader(
                        session_id=reply.session_id, fragment_id=f, base_version=-1,
                        kind=pb.PUSH_KIND_INITIAL,
                    )  # fmt: skip
                    client.push(header, initial[f])
        owned: list[list[int]] = [[] for _ in self.addresses]
        for f in range(FRAGMENTS):
            owned[self.clients[0].shard_of(f)].append(f)
        return owned

    def settled(self, min_versions: int) -> bool:
        """Every fragment has reached `min_versions` and, if that is at least 1, the probe
        has timed a pull."""
        with self.lock:
            reached = min(self.latest) >= min_versions
            return reached and (min_versions < 1 or bool(self.pull_latencies))

    def bytes_sent(self) -> int:
        """Bytes the learners handed to their channels (pushes, as they stream)."""
        return sum(client.traffic.sent for client in self.clients)

    def count_error(self, err: grpc.RpcError | ValueError) -> None:
        code = err.code().name if isinstance(err, grpc.RpcError) else type(err).__name__
        detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
        with self.lock:
            self.errors[code] = self.errors.get(code, 0) + 1
            self.error_details.setdefault(code, str(detail))

    def count_retry(self, err: grpc.RpcError, _delay_s: float) -> None:
        with self.lock:
            self.retried[err.code().name] = self.retried.get(err.code().name, 0) + 1

    def push_loop(self, i: int, fragments: list[int], payloads: list[bytes]) -> None:
        """One learner's thread for one shard: push each fragment, wait for the round it joined."""
        client, session = self.clients[i], self.sessions[i]
        versions, rounds = dict.fromkeys(fragments, 0), dict.fromkeys(fragments, 0)
        try:
            while not self.stop.is_set():
                for f in fragments:
                    header = pb.PushHeader(
                        session_id=session, fragment_id=f, base_version=versions[f],
                        inner_steps=50, tokens=50 * 2048, kind=pb.PUSH_KIND_DELTA,
                    )  # fmt: skip
                    # As a learner's sync thread does: a refusal with a retry hint (the
                    # push memory budget is in use) or a deadline is tried again.
                    started = time.perf_counter()
                    answer = call_with_retry(
                        lambda h=header, f=f: client.push(h, payloads[f]), self.stop,
                        self.count_retry,
                    )  # fmt: skip
                    rounds[f] = answer.round_version
                    with self.lock:
                        self.pushes += 1
                        self.push_spans.append((started, time.perf_counter()))
                for f in fragments:
                    with self.advanced:  # a watcher long-polls; learners wait here
                        while self.latest[f] < rounds[f] and not self.stop.is_set():
                            self.advanced.wait(1.0)
                    with self.pulls:  # the update, as a learner takes it at its merge
                        head, _ = client.pull(session, f, versions[f], self.latest[f], 0.0)
                    versions[f] = head.version
        except (grpc.RpcError, ValueError) as err:  # ValueError: a channel closed at the end
            if not self.stop.is_set():
                self.count_error(err)
        except Stopped:
            pass

    def close(self, threads: list[threading.Thread]) -> None:
        """End the run's `threads`: closing the channels cancels the calls in flight, so
        the threads end at once."""
        self.stop.set()
        with self.advanced:
            self.advanced.notify_all()
        for client in self.clients:
            client.close()
        for thread in threads:
            thread.join(timeout=30)

    def watch_loop(self, f: int) -> None:
        """Long-poll one fragment's next version and wake the learners waiting for it."""
        client, session = self.clients[-1], self.sessions[-1]
        version = 0
        try:
            while not self.stop.is_set():
                head, _ = client.pull(session, f, version, version + 1, 5.0)
                if head.version > version:
                    version = head.version
                    with self.advanced:
                        self.latest[f] = version
                        self.closes.append(time.perf_counter())
                        self.advanced.notify_all()
        except (grpc.RpcError, ValueError) as err:  # ValueError: a channel closed at the end
            if not self.stop.is_set():
                self.count_error(err)

    def probe_loop(self, every_s: float = 1.0) -> None:
        """Every `every_s`, pull one available update of each fragment and time it, on
        channels of its own (a learner's are busy with its pushes)."""
        client, session = self.clients[-1], self.sessions[-1]
        try:
            while not self.stop.wait(every_s):
                for f in range(FRAGMENTS):
                    version = self.latest[f]
                    if version < 1:
                        continue
                    started = time.perf_counter()
                    client.pull(session, f, version - 1, version, 0.0)
                    ended = time.perf_counter()
                    with self.lock:
                        self.pull_latencies.append(ended - started)
                        self.pull_spans.append((started, ended))
        except (grpc.RpcError, ValueError) as err:  # ValueError: a channel closed at the end
            if not self.stop.is_set():
                self.count_error(err)
