"""TLS and mutual TLS between learners and the server, with throwaway certificates.

Certificates are made at run time by deploy/make_certs.sh (the openssl command-line tool);
no key is committed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from common.config import build_config
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.tls import channel_credentials
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


def test_make_certs_keeps_the_ca_and_server_and_adds_learners(pki: Path) -> None:
    before = {name: (pki / name).read_bytes() for name in ("ca.key", "server.crt")}
    added = make_certs(pki, "DNS:elsewhere", "late-learner")
    assert added.returncode == 0, added.stderr
    assert {name: (pki / name).read_bytes() for name in before} == before
    assert "kept server.crt" in added.stdout and (pki / "late-learner.crt").exists()
    assert oct((pki / "late-learner.key").stat().st_mode & 0o777) == "0o600"
    for args in [["localhost"], ["DNS:x", "../evil"], []]:
        refused = make_certs(pki, *args)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr


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


def pem_pair(pki: Path, name: str) -> tuple[str, str]:
    return str(pki / f"{name}.crt"), str(pki / f"{name}.key")


def test_a_learner_process_trains_over_mutual_tls(start_service, pki: Path) -> None:
    service = start_service(
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
    )
    flags = [f for f in TINY_LEARNER_FLAGS if f != "--insecure"]
    cert, key = pem_pair(pki, "learner")
    result = subprocess.run(
        [
            sys.executable, "-m", "learner.main", "--server", f"127.0.0.1:{service.port}",
            "--learner-id", "tls-learner", *flags, "--max-outer-steps", "2",
            "--tls-ca", str(pki / "ca.crt"), "--tls-cert", cert, "--tls-key", key,
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "outer_steps=2" in result.stdout
    assert service.aggregator.version(0) >= 2


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
    with pytest.raises(ValueError, match="is not PEM"):
        channel_credentials(str(pki / "ca.srl"))
