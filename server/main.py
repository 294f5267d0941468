"""diloco-server: the aggregator daemon. AggregatorService runs the gRPC server, the
servicer, health (also on a plaintext port of its own when health_listen is set), reflection
(when on) and the reaper that expires leases and cuts overdue streams; main() parses the
flags into a ServerConfig, applies the process-wide settings (below), and serves until
SIGINT/SIGTERM, always stopping cleanly.

    diloco-server --listen 127.0.0.1:50051 --lease-s 10 --insecure     # or --tls-cert/--tls-key

    config = build_config(ServerConfig, {"listen": "127.0.0.1:0", "insecure": True})
    service = AggregatorService(config)   # integration tests run it in-process, on port 0
    service.start()                       # service.port is the bound port
    service.stop()

Process-wide settings: a few glibc malloc arenas, one torch thread per call, and free heap
pages handed back once a second.

Why (bench/load.py, 64 learners, 4 MiB model): glibc gives threads that contend for malloc
their own arena, up to 8 per core, and an arena keeps the memory freed into it. The server
runs a thread per RPC (a few hundred), and every push and pull allocates and frees buffers of
about a payload (gRPC messages, protobuf copies, decode chunks), so freed memory piled up in
many arenas: peak RSS 1.1 GB with the streaming ingest of server/rounds/ingest.py, 0.6 GB with two
arenas, at the same push rate. Forcing those buffers out to mmap instead
(MALLOC_MMAP_THRESHOLD_=131072) bounds memory too but cost 60% of the push rate here: every
buffer then costs page faults, which are slow in a VM.

Torch threads: the server's parallelism is its concurrent pushes (rounds/ingest.py slots), and
each RPC thread that enters an OpenMP region gets its own team of workers. With a busy CPU a
team waits for preempted workers at every barrier: the ingest of a 4 M-value fp4 push took
68 ms with 2 torch threads and 20 ms with 1 here (load average 6 on 2 cores).

An explicit MALLOC_ARENA_MAX in the environment wins (glibc has already applied it); on a
libc other than glibc nothing is changed and a log line says so.

Trimming: even with two arenas, the heap fragments. Model-sized buffers (round sums, outer
updates, snapshots) and message-sized ones (pushes, pull chunks) are made and freed by many
threads at once, and the free space between live blocks stays resident: at 64 learners
(bench/load.py, 4 MiB model) glibc held ~0.5 GB free against ~0.16 GB in use, and RSS grew
with the learners. malloc_trim(0) hands the free pages back (measured: peak RSS 664 -> 468 MB,
pushes/s unchanged) but holds the arena locks while it walks them (10-40 ms here), so it runs
once a second on its own thread: every 0.25 s gave 395 MB and cost a fifth of the push rate.
Returning every large buffer to the system instead (MALLOC_MMAP_THRESHOLD_=2 MiB) gave 420 MB
but cost a third of the push rate in page faults.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import platform
import signal
import threading

import torch
from grpc_reflection.v1alpha import reflection

from common.config import config_parser, parse_command_line
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc
from common.metrics_http import serve_metrics, write_port_file
from common.rpc import (
    SERVICE_NAME,
    create_health_server,
    create_server,
    new_health,
    set_serving,
)
from common.tracing import init_tracing
from server.aggregator import Aggregator
from server.config import ServerConfig
from server.rpc.auth import CertificateIdentity, TokenAuth
from server.rpc.calls import EndableCalls
from server.rpc.limits import InFlightLimit, RateLimit, StreamDeadlines
from server.rpc.metrics import ServerMetrics
from server.rpc.receive import ChunkViews, PushBudget
from server.rpc.servicer import AggregatorServicer
from server.status_report import status_pages

log = logging.getLogger("diloco.server")

TICK_S = 0.05


class AggregatorService:
    """Owns the Aggregator, its gRPC server and the thread that expires leases."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.aggregator = Aggregator(config, events=self.metrics)
        network, limits = config.network, config.limits
        if network.insecure:
            log.warning(
                "serving WITHOUT TLS (insecure): anyone who can reach %s can read and send "
                "parameters; use tls_cert/tls_key outside a trusted network",
                network.listen,
            )
        self.auth = TokenAuth(network.auth_token_file) if network.auth_token_file else None
        self.rate_limit = (
            RateLimit(limits.rate_limit_calls_per_s, limits.rate_limit_burst)
            if limits.rate_limit_calls_per_s > 0
            else None
        )
        self.in_flight = (
            InFlightLimit(limits.max_calls_in_flight) if limits.max_calls_in_flight > 0 else None
        )
        self.deadlines = (
            StreamDeadlines(limits.stream_idle_timeout_s, limits.stream_min_bytes_per_s)
            if limits.stream_idle_timeout_s > 0
            else None
        )
        # ChunkViews first: it gives PushFragment a request deserializer whatever the others do.
        # EndableCalls next: every call then has a Call that others may end (calls.py).
        # Authentication before the limits: they then key on verified learner ids. Deadlines
        # last: they watch the handler's own waits on its peer.
        identity = CertificateIdentity() if network.tls_client_id_from_cert else None
        chain = (ChunkViews(), EndableCalls(), self.auth, identity, self.rate_limit)
        chain += (self.in_flight, self.deadlines)
        # NOT_SERVING once the state dir fails (the reaper checks): orchestrators see it.
        self.health = new_health()
        self._server, self.port = create_server(
            network.listen,
            network.credentials(),
            max_workers=limits.worker_threads,
            interceptors=tuple(i for i in chain if i is not None),
            max_concurrent_streams=limits.max_concurrent_streams,
            health_servicer=self.health,
        )
        mb = limits.push_memory_budget_mb
        budget = PushBudget(
            int(mb * 2**20) if mb else None,
            limits.push_budget_wait_s,
            drain=self.aggregator.settle_deferred,
        )
        self.servicer = AggregatorServicer(self.aggregator, push_budget=budget)
        self.metrics.watch(self.aggregator, self.servicer, self.rate_limit, self.in_flight)
        self.metrics.watch_cuts(self.deadlines, self.auth)
        pb_grpc.add_AggregatorServicer_to_server(self.servicer, self._server)
        if network.reflection:
            reflection.enable_server_reflection(
                (pb.DESCRIPTOR.services_by_name["Aggregator"].full_name, reflection.SERVICE_NAME),
                self._server,
            )
        # Plaintext health for probes that cannot speak TLS: a server of its own, so that
        # nothing else is ever served without the main port's TLS.
        self._health_server, self.health_port = (
            create_health_server(network.health_listen, self.health)
            if network.health_listen
            else (None, 0)
        )
        self._stopping = threading.Event()
        self._reaper = threading.Thread(target=self._expire_leases, name="reaper", daemon=True)

    def start(self) -> None:
        """Serve; if any part cannot start, whatever did is stopped and the error raised."""
        try:
            self._start()
        except BaseException:
            self._stopping.set()  # the reaper, if it started
            # wait(): stop() only begins a shutdown; the ports are free once it is done.
            self._server.stop(grace=0).wait()
            if self._health_server is not None:
                self._health_server.stop(grace=0).wait()
            raise

    def _start(self) -> None:
        self._server.start()
        if self._health_server is not None:
            self._health_server.start()
            log.info("serving grpc.health.v1 alone, in plaintext, on port %d", self.health_port)
        self._reaper.start()
        log.info(
            "serving %s on port %d mode=%s epoch=%d",
            SERVICE_NAME,
            self.port,
            self.config.rounds.mode,
            self.aggregator.server_epoch,
        )
        if self.config.network.port_file:
            write_port_file(self.config.network.port_file, self.port)

    def stop(self, grace_s: float = 2.0) -> None:
        self._stopping.set()
        if self._health_server is not None:
            self._health_server.stop(grace=0).wait()  # first: probes see it going at once
        self._server.stop(grace=grace_s).wait()
        self.aggregator.checkpoint()  # logs the snapshot it writes (state/store.py)
        for fid, counts in self.servicer.traffic.by_fragment().items():
            log.info(
                "fragment=%d bytes_received=%d bytes_sent=%d",
                fid,
                counts["received"],
                counts["sent"],
            )
        log.info("stopped; %s", self._where_the_state_is())

    def _where_the_state_is(self) -> str:
        """The last line's account of the state: a user stopping a run wants to know what a
        restart resumes from (the snapshot itself is logged as it is written)."""
        if not (state_dir := self.config.persistence.state_dir):
            return "no state_dir, so nothing was saved: a restart starts from the first join"
        if (failure := self.aggregator.state_failure()) is not None:
            return (
                f"no final snapshot, as {state_dir} failed ({failure}); a restart resumes from it"
            )
        return f"the state is in {state_dir}"

    def _expire_leases(self) -> None:
        # Often enough for grace windows; a dead learner is dropped within a lease and a tick,
        # a stream past its deadline is cut within a tick.
        serving = True
        while not self._stopping.wait(min(self.config.membership.lease_s / 4, TICK_S)):
            if serving and self.aggregator.state_failure() is not None:
                serving = False
                set_serving(self.health, False)
            chores = (self.aggregator.tick, self.deadlines.sweep if self.deadlines else None)
            for chore in filter(None, chores):
                try:
                    chore()
                except Exception:  # noqa: BLE001 - leases must keep expiring whatever happened
                    log.exception("tick failed; trying again at the next one")


# ---- Process-wide settings ---------------------------------------------------------------

M_ARENA_MAX = -8  # from glibc's malloc.h
DEFAULT_ARENAS = 2
DEFAULT_TRIM_INTERVAL_S = 1.0


def limit_malloc_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas`; returns whether the cap was set by this call."""
    if "MALLOC_ARENA_MAX" in os.environ:
        log.info("malloc: MALLOC_ARENA_MAX=%s from the environment", os.environ["MALLOC_ARENA_MAX"])
        return False
    if (mallopt := _glibc_function("mallopt", "arena limit not set")) is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_ARENA_MAX, arenas) != 1:
        log.warning("malloc: mallopt(M_ARENA_MAX, %d) failed; arena limit not set", arenas)
        return False
    log.info("malloc: at most %d glibc arenas (bounded server memory, server/main.py)", arenas)
    return True


def _glibc_function(name: str, otherwise: str):
    """glibc's function `name` from this process, or None (after a log line ending in
    `otherwise`) on another libc or where it cannot be found."""
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        log.info("malloc: libc is %s, not glibc; %s", libc_name or "unknown", otherwise)
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError) as err:
        log.warning("malloc: %s not found (%s); %s", name, err, otherwise)
        return None


def single_threaded_torch() -> None:
    """One intra-op thread per calling thread (see the module docstring)."""
    torch.set_num_threads(1)
    log.info("torch: 1 intra-op thread per RPC thread")


def start_malloc_trimmer(
    stop: threading.Event, interval_s: float = DEFAULT_TRIM_INTERVAL_S
) -> bool:
    """Hand glibc's free heap pages back to the system every `interval_s` until `stop` is set
    (see the module docstring); returns whether the trimmer thread was started."""
    if interval_s <= 0:
        raise ValueError(f"malloc trim interval must be > 0 s, got {interval_s}")
    if (malloc_trim := _glibc_function("malloc_trim", "heap not trimmed")) is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int

    def trim() -> None:
        while not stop.wait(interval_s):  # ctypes releases the GIL for the call
            malloc_trim(0)

    threading.Thread(target=trim, name="malloc-trim", daemon=True).start()
    log.info("malloc: free heap pages handed back every %.2f s", interval_s)
    return True


# ---- The daemon ----------------------------------------------------------------------------


def parse_config(argv: list[str], environ: dict[str, str] | None = None) -> ServerConfig:
    """The config that `diloco-server ARGV` runs with (tests build theirs the way users do)."""
    return parse_command_line(build_parser(), ServerConfig, argv, environ or {})


def build_parser() -> argparse.ArgumentParser:
    return config_parser("diloco-server", "diloco-server: the aggregator service.", ServerConfig)


def main() -> None:
    parser = build_parser()
    config = parse_command_line(parser, ServerConfig)
    observability = config.observability
    logging.basicConfig(level=observability.log_level, format="%(asctime)s %(name)s %(message)s")
    limit_malloc_arenas()  # before the server's threads start allocating
    single_threaded_torch()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    start_malloc_trimmer(stop)  # bounded RSS under many learners
    try:
        if observability.trace_exporter:  # first: a missing package stops the server at once
            exporter, endpoint = observability.trace_exporter, observability.trace_endpoint
            init_tracing(exporter, endpoint, "diloco-server")
        service = AggregatorService(config)
        if observability.metrics_listen:
            bound: list[int] = []  # the status page links with the port once it is bound
            pages = {}
            if observability.status_page:
                traffic = service.servicer.traffic
                pages = status_pages(service.aggregator, traffic, config, lambda: bound[0])
            registry, port_file = service.metrics.registry, observability.metrics_port_file
            bound.append(serve_metrics(observability.metrics_listen, registry, port_file, pages))
            logging.getLogger("diloco.server").info(
                "metrics on port %d at /metrics%s", bound[0], ", status at /status" * bool(pages)
            )
        if service.auth is not None:  # before start(): a SIGHUP must never find the default
            signal.signal(signal.SIGHUP, lambda *_: reload_tokens(service))
        service.start()
    except (OSError, ValueError) as err:  # a port in use, an unreadable certificate or port file
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    try:
        # Wake up now and then: Python runs signal handlers in the main thread, and a signal
        # the kernel hands to another thread (gRPC's, the trimmer) does not interrupt a wait
        # without a timeout, so a SIGHUP could otherwise sit unhandled (seen in CI).
        while not stop.wait(0.2):
            pass
    finally:
        service.stop()


def reload_tokens(service: AggregatorService) -> None:
    """SIGHUP: re-read the token file, so an edited file revokes or adds learners."""
    log = logging.getLogger("diloco.server")
    try:
        log.info("auth: reloaded %d learner tokens", service.auth.reload())
    except ValueError as err:
        log.error("auth: token file not reloaded, keeping the old tokens: %s", err)


if __name__ == "__main__":
    main()
