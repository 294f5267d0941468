"""The learner's channel to the aggregator: TLS credentials and the per-call metadata.

    client = connect(config.connection)    # a ShardedClient; nothing is sent yet

Every call carries the learner id (the server's rate limits are per learner,
server/rpc/limits.py) and, with an auth_token_file, the learner's token (server/rpc/auth.py).
A token file that cannot be read ends in one ValueError naming it; a server that cannot be
reached, in the one sentence of `unreachable` (diloco-learner's and diloco-status's).
"""

from __future__ import annotations

from pathlib import Path

from common.rpc import LEARNER_ID_HEADER
from common.tls import channel_credentials, speaks_tls
from learner.config import ConnectionConfig
from learner.shards import ShardedClient


def connect(config: ConnectionConfig) -> ShardedClient:
    """A client for the shards `config.server` lists (or the one it names and the others it
    advertises: learner/shards.py), in plaintext only when `insecure` says so."""
    credentials = (
        None
        if config.insecure
        else channel_credentials(config.tls_ca, config.tls_cert, config.tls_key)
    )
    return ShardedClient(config.addresses(), credentials, auth_metadata(config))


def auth_metadata(config: ConnectionConfig) -> tuple[tuple[str, str], ...]:
    """The learner id and token that go with every call. Without a token the id still goes."""
    if not config.auth_token_file:
        return ((LEARNER_ID_HEADER, config.learner_id),)
    try:
        token = Path(config.auth_token_file).read_text().strip()
    except OSError as err:
        raise ValueError(
            f"cannot read auth_token_file {config.auth_token_file}: {err.strerror}"
        ) from err
    if not token:
        raise ValueError(f"auth_token_file {config.auth_token_file} is empty")
    return ((LEARNER_ID_HEADER, config.learner_id), ("authorization", f"Bearer {token}"))


def unreachable(config: ConnectionConfig) -> str:
    """Why the server did not answer, in one sentence: it speaks plaintext where `config` asks
    for TLS or the other way round (the commonest first-run mistake, which gRPC reports only
    as UNAVAILABLE), or else that it cannot be reached."""
    for address in config.addresses():
        tls = speaks_tls(address)
        if tls and config.insecure:
            return (
                f"the server at {address} serves TLS, but this client is set to insecure: "
                "drop insecure and set tls_ca to the CA that signed the server's certificate"
            )
        if tls is False and not config.insecure:
            return (
                f"the server at {address} serves plaintext (insecure), but this client uses "
                "TLS: set insecure here too, or start the server with tls_cert and tls_key"
            )
    return (
        f"cannot reach the server at {config.server} (is it up, and do both sides agree on "
        "TLS or insecure?)"
    )
