"""diloco-status: what every shard of a run sees now.

    diloco-status --server shard0:50051 --insecure            # the others are discovered
    diloco-status --server a:50051,b:50051 --tls-ca ca.pem --auth-token-file tok --learner-id ops

For each shard: its index, the map id, the mode, the outer steps its fragments took (rounds
closed), each owned fragment's version and parameter CRC, and every learner it knows with
its last accepted push. It connects as a learner does (the same TLS and token settings; a
token belongs to a learner id) and changes nothing. Exits 1 if a shard cannot be reached.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict

from common.config import config_parser, parse_command_line
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import RETRYABLE
from learner.config import ConnectionConfig
from learner.connection import connect, unreachable


@dataclass(kw_only=True)
class OutputConfig:
    """How diloco-status prints."""

    json: bool = False
    """Print one JSON object per shard (a line each) instead of text."""


@dataclass(kw_only=True)
class StatusConfig:
    """diloco-status's settings: a learner's connection settings, and the output."""

    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def format_shard(address: str, status: pb.StatusResponse | grpc.RpcError) -> list[str]:
    """Text lines for one shard's Status answer (or the error that replaced it)."""
    if isinstance(status, grpc.RpcError):
        return [f"shard at {address}: unreachable ({status.code().name}: {status.details()})"]
    lines = [
        f"shard {status.shard_index} of {status.shard_count} at {address}: "
        f"map {status.map_id or '-'} mode {status.mode} rounds closed {status.rounds_closed}"
    ]
    for f in status.fragments:
        values = f"crc {f.params_crc32:#010x}" if f.version >= 0 else "no parameters yet"
        lines.append(f"  fragment {f.fragment_id}: version {f.version} {values}")
    for learner in status.learners:
        push = (
            f"last push fragment {learner.last_push_fragment} for version "
            f"{learner.last_push_version}, {learner.last_push_age_s:.1f} s ago"
            if learner.last_push_fragment >= 0
            else "no push since the shard started"
        )
        state = "live" if learner.live else "gone"
        lines.append(f"  learner {learner.learner_id}: {state}, {push}")
    if not status.learners:
        lines.append("  no learners")
    for change in status.setting_changes:
        lines.append(f"  setting {change.setting}: {change.was} -> {change.now} since the restart")
    return lines


def shard_statuses(config: ConnectionConfig) -> list[tuple[str, pb.StatusResponse | grpc.RpcError]]:
    """(address, Status answer or its error) of every shard, in index order."""
    client = connect(config)
    try:
        client.discover()
        answers: list[tuple[str, pb.StatusResponse | grpc.RpcError]] = []
        for address, shard in zip(client.addresses, client.shards(), strict=True):
            try:
                answers.append((address, shard.status()))
            except grpc.RpcError as err:
                answers.append((address, err))
        return answers
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("diloco-status", __doc__.splitlines()[0], StatusConfig)
    config = parse_command_line(parser, StatusConfig, argv)
    try:
        answers = shard_statuses(config.connection)
    except grpc.RpcError as err:  # the one address given, asked for the others
        why = (
            unreachable(config.connection)
            if err.code() in RETRYABLE  # down, or not speaking what this client speaks
            else f"the server at {config.connection.server} answered {err.code().name}: "
            f"{err.details()}"
        )
        parser.exit(1, f"diloco-status: error: {why}\n")
    except ValueError as err:  # an unreadable token file, a run that lists no addresses
        parser.exit(2, f"diloco-status: error: {err}\n")
    for address, status in answers:
        if config.output.json:
            body = (
                {"error": status.code().name}
                if isinstance(status, grpc.RpcError)
                else MessageToDict(
                    status,
                    always_print_fields_with_no_presence=True,
                    preserving_proto_field_name=True,
                )
            )
            print(json.dumps({"address": address, **body}))
        else:
            print("\n".join(format_shard(address, status)))
    return 1 if any(isinstance(s, grpc.RpcError) for _, s in answers) else 0


if __name__ == "__main__":
    sys.exit(main())
