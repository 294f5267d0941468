"""Transport security for both sides: TLS, optionally mutual (client certificates).

    creds = server_credentials("server.crt", "server.key", client_ca="ca.crt")  # mTLS
    creds = channel_credentials(ca="ca.crt", cert="learner.crt", key="learner.key")

Files are PEM. A missing or unreadable file is a ValueError that names the setting, so the
daemons report it in one line. Plaintext is only ever chosen explicitly (`insecure`), and a
client that cannot connect asks `speaks_tls` whether the two sides chose alike.
"""

from __future__ import annotations

import socket
import ssl

import grpc


def read_pem(path: str, setting: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ValueError(f"cannot read {setting} file {path}: {err.strerror}") from err
    if b"-----BEGIN " not in data:
        raise ValueError(f"{setting} file {path} is not PEM (no -----BEGIN line)")
    return data


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS with this certificate chain and key; with `client_ca`, every client must present
    a certificate signed by it (mutual TLS)."""
    pair = (read_pem(key, "tls_key"), read_pem(cert, "tls_cert"))
    if not client_ca:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=read_pem(client_ca, "tls_client_ca"), require_client_auth=True
    )


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS to the server, verified against `ca` (default: the system's roots); with cert and
    key, presents a client certificate for mutual TLS."""
    if bool(cert) != bool(key):
        raise ValueError("tls_cert and tls_key must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "tls_ca") if ca else None,
        private_key=read_pem(key, "tls_key") if key else None,
        certificate_chain=read_pem(cert, "tls_cert") if cert else None,
    )


def speaks_tls(address: str, timeout_s: float = 2.0) -> bool | None:
    """Whether the server at `address` (host:port) answers a TLS handshake: True, False (it
    answers, but not in TLS: a plaintext server), or None (no answer at all). Verifies
    nothing: it only tells a client that failed to connect which of the two it met."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])  # as gRPC offers: a server may refuse a hello without
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout_s) as sock:
            with context.wrap_socket(sock, server_hostname=host.strip("[]")):
                return True
    except ssl.SSLError as err:
        # An alert is TLS too: the server refused this hello (e.g. it wants a certificate).
        return "ALERT" in (err.reason or "")
    except TimeoutError:
        return None  # connected, or not, but silent: nothing to tell from that
    except ConnectionResetError:
        return False  # accepted, then dropped the hello: not TLS
    except (OSError, ValueError):
        return None  # nothing listens there, or no such host
