"""TLS and mutual TLS between learners and the server, with throwaway certificates.

Certificates are made at run time by deploy/make_certs.sh (the openssl command-line tool);
no key is committed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import build_config
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.generated.diloco.v1.aggregator_pb2_grpc import AggregatorStub
from common.rpc import LEARNER_ID_HEADER, SERVICE_NAME
from common.tls import channel_credentials, speaks_tls
from learner.client import AggregatorClient
from server.config import ServerConfig
from tests.support.processes import REPO, TINY_LEARNER_FLAGS

SPECS = [pb.ParamSpec(name="w", shape=[4], dtype="float32")]
MAKE_CERTS = REPO / "deploy" / "make_certs.sh"


def make_certs(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(MAKE_CERTS), str(folder), *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """The certificates deploy/make_certs.sh makes, plus an intruder's from another CA."""
    folder, rogue = tmp_path_factory.mktemp("pki"), tmp_path_factory.mktemp("rogue")
    assert make_certs(folder, "IP:127.0.0.1,DNS:localhost", "learner").returncode == 0
    assert make_certs(rogue, "DNS:localhost", "intruder").returncode == 0
    (folder / "rogue-ca.crt").write_bytes((rogue / "ca.crt").read_bytes())
    for suffix in (".crt", ".key"):
        (folder / f"intruder{suffix}").write_bytes((rogue / f"intruder{suffix}").read_bytes())
    return folder


def test_make_certs_keeps_what_is_there_and_adds_learners(pki: Path) -> None:
    before = {p.name: p.read_bytes() for p in pki.iterdir()}
    added = make_certs(pki, "IP:127.0.0.1,DNS:localhost", "late-learner", "learner")
    assert added.returncode == 0, added.stderr
    assert {name: (pki / name).read_bytes() for name in before} == before
    assert "kept server.crt" in added.stdout and "kept learner.crt" in added.stdout
    assert oct((pki / "late-learner.key").stat().st_mode & 0o777) == "0o600"
    assert oct((pki / "late-learner.crt").stat().st_mode & 0o777) == "0o644"


@pytest.mark.parametrize(
    "args, message",
    [
        (["localhost"], "SERVER_SAN must be DNS:name or IP:address"),
        (["IP:127.0.0.1,DNS:localhost", "../evil"], "bad learner id '../evil'"),
        (["IP:127.0.0.1,DNS:localhost", "twin", "twin"], "learner id 'twin' is given twice"),
        ([], "usage: make_certs.sh DIR SERVER_SAN"),
        (["DNS:elsewhere", "new-learner"], "server.crt was made for SERVER_SAN 'IP:127.0.0.1,"),
    ],
)
def test_make_certs_refuses_bad_input_in_one_line(pki: Path, args: list, message: str) -> None:
    before = {p.name: p.read_bytes() for p in pki.iterdir()}
    refused = make_certs(pki, *args)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert message in refused.stderr
    assert {p.name: p.read_bytes() for p in pki.iterdir()} == before


def test_make_certs_changes_nothing_when_openssl_fails(tmp_path: Path) -> None:
    refused = make_certs(tmp_path, "IP:not-an-address", "learner")  # openssl refuses the SAN
    assert refused.returncode == 2 and "openssl could not make server.crt" in refused.stderr
    assert list(tmp_path.iterdir()) == []  # not even the CA it made first
    ca = tmp_path / "ca"
    assert make_certs(ca, "DNS:localhost").returncode == 0
    (ca / "ca.key").unlink()  # kept off the machine, as advised: no silent new CA
    refused = make_certs(ca, "DNS:localhost", "learner")
    assert refused.returncode == 2 and "only one of ca.key and ca.crt" in refused.stderr


def connects(port: int, credentials: grpc.ChannelCredentials | None) -> bool:
    client = AggregatorClient(f"127.0.0.1:{port}", credentials)
    try:
        client.wait_ready(3)
        client.join("probe", SPECS)
        return True
    except (grpc.FutureTimeoutError, grpc.RpcError):
        return False
    finally:
        client.close()


def test_tls_server_accepts_only_clients_that_verify_it(start_service, pki: Path) -> None:
    service = start_service(tls_cert=str(pki / "server.crt"), tls_key=str(pki / "server.key"))
    assert connects(service.port, channel_credentials(str(pki / "ca.crt")))
    assert not connects(service.port, None)  # plaintext to a TLS server
    assert not connects(service.port, channel_credentials(str(pki / "rogue-ca.crt")))


def test_mutual_tls_requires_a_certificate_from_the_ca(start_service, pki: Path) -> None:
    service = start_service(
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
    )
    ca = str(pki / "ca.crt")
    assert connects(service.port, channel_credentials(ca, *pem_pair(pki, "learner")))
    assert not connects(service.port, channel_credentials(ca))  # no client certificate
    assert not connects(service.port, channel_credentials(ca, *pem_pair(pki, "intruder")))


def test_the_health_port_answers_in_plaintext_and_serves_nothing_else(
    start_service, pki: Path
) -> None:
    """For the kubelet's grpc probe, which speaks no TLS; the service itself stays behind TLS."""
    service = start_service(
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
        health_listen="127.0.0.1:0",
    )
    assert service.health_port not in (0, service.port)
    channel = grpc.insecure_channel(f"127.0.0.1:{service.health_port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            AggregatorStub(channel).Join(pb.JoinRequest(learner_id="probe"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()
    assert not connects(service.port, None)  # the service's own port stays TLS-only


def joins_as(port: int, credentials, header_id: str, learner_id: str) -> grpc.StatusCode:
    """The status of a Join as `learner_id` whose calls claim `header_id`."""
    client = AggregatorClient(f"127.0.0.1:{port}", credentials, ((LEARNER_ID_HEADER, header_id),))
    try:
        client.wait_ready(5)
        client.join(learner_id, SPECS)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()
    finally:
        client.close()


def test_a_certificate_binds_its_holder_to_one_learner_id(start_service, pki: Path) -> None:
    """tls_client_id_from_cert: the holder of the certificate for "learner" may not join as
    another learner, so it cannot multiply its share of a merge."""
    service = start_service(
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
        tls_client_id_from_cert=True,
    )
    learner = channel_credentials(str(pki / "ca.crt"), *pem_pair(pki, "learner"))
    assert joins_as(service.port, learner, "learner", "learner") == grpc.StatusCode.OK
    assert joins_as(service.port, learner, "sybil", "sybil") == grpc.StatusCode.UNAUTHENTICATED
    # The header is the certificate's, the join is for another: refused by the servicer.
    assert joins_as(service.port, learner, "learner", "sybil") == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert service.aggregator.live_learners() == ["learner"]


def pem_pair(pki: Path, name: str) -> tuple[str, str]:
    return str(pki / f"{name}.crt"), str(pki / f"{name}.key")


def test_a_learner_process_trains_over_mutual_tls_bound_to_its_certificate(
    start_service, pki: Path
) -> None:
    """The learner's id is its certificate's name (deploy/make_certs.sh), so the server may
    bind the two (tls_client_id_from_cert) and the learner trains as usual."""
    service = start_service(
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
        tls_client_id_from_cert=True,
    )
    flags = [f for f in TINY_LEARNER_FLAGS if f != "--insecure"]
    cert, key = pem_pair(pki, "learner")
    result = subprocess.run(
        [
            sys.executable, "-m", "learner.main", "--server", f"127.0.0.1:{service.port}",
            "--learner-id", "learner", *flags, "--max-outer-steps", "2",
            "--tls-ca", str(pki / "ca.crt"), "--tls-cert", cert, "--tls-key", key,
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "outer_steps=2" in result.stdout
    assert service.aggregator.version(0) >= 2


def test_a_client_is_told_when_it_and_the_server_chose_differently_between_tls_and_plaintext(
    start_service, pki: Path
) -> None:
    """diloco-status and diloco-learner name the mismatch (learner/connection.py) where gRPC
    says only UNAVAILABLE, and the scripts (learner/entry.py) keep gRPC's own SSL lines off
    the terminal: diloco-status's whole stderr is its one sentence."""
    tls = start_service(tls_cert=str(pki / "server.crt"), tls_key=str(pki / "server.key"))
    plain = start_service()
    assert speaks_tls(f"127.0.0.1:{tls.port}") is True
    assert speaks_tls(f"127.0.0.1:{plain.port}") is False
    to_tls = f"the server at 127.0.0.1:{tls.port} serves TLS, but this client is set to insecure"
    to_plain = f"the server at 127.0.0.1:{plain.port} serves plaintext (insecure), but this "
    to_plain += "client uses TLS: set insecure here too, or start the server with tls_cert and"
    ca = ["--tls-ca", str(pki / "ca.crt")]
    learner = [f for f in TINY_LEARNER_FLAGS if f != "--insecure"]
    for prog, script, port, flags, message in [
        ("diloco-status", "status", tls.port, ["--insecure"], to_tls),
        ("diloco-status", "status", plain.port, ca, to_plain),
        ("diloco-learner", "learner", plain.port, [*learner, "--connect-timeout-s", "1", *ca],
         to_plain),
    ]:  # fmt: skip
        entry = f"import sys; from learner.entry import {script}; sys.exit({script}())"
        result = subprocess.run(
            [sys.executable, "-c", entry, "--server", f"127.0.0.1:{port}", *flags],
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"},
        )  # fmt: skip
        assert result.returncode == 1, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith(f"{prog}: error: {message}"), lines[-1]
        assert "ssl_transport_security" not in result.stderr, result.stderr[-2000:]
        if prog == "diloco-status":
            assert len(lines) == 1, result.stderr


def server_config(**settings) -> ServerConfig:
    return build_config(ServerConfig, settings)


def test_plaintext_is_never_the_silent_default(pki: Path) -> None:
    with pytest.raises(ValueError, match="or insecure to serve in plaintext"):
        server_config(listen="127.0.0.1:0")
    with pytest.raises(ValueError, match="exclude each other"):
        server_config(listen="127.0.0.1:0", insecure=True, tls_cert=str(pki / "server.crt"))
    config = server_config(listen="127.0.0.1:0", tls_cert="/nope.crt", tls_key="/nope.key")
    with pytest.raises(ValueError, match="cannot read tls_key file"):
        config.network.credentials()
    with pytest.raises(ValueError, match="tls_client_id_from_cert needs tls_client_ca"):
        server_config(
            listen="127.0.0.1:0",
            tls_cert=str(pki / "server.crt"),
            tls_key=str(pki / "server.key"),
            tls_client_id_from_cert=True,
        )
    with pytest.raises(ValueError, match="health_listen must have a port of its own"):
        server_config(listen="127.0.0.1:7000", insecure=True, health_listen="127.0.0.1:7000")
    with pytest.raises(ValueError, match="health_listen must be host:port"):
        server_config(listen="127.0.0.1:0", insecure=True, health_listen="7000")
    with pytest.raises(ValueError, match="is not PEM"):
        channel_credentials(str(pki / "server.san"))
