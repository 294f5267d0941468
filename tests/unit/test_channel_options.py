"""The one channel factory bounds gRPC's reconnect backoff (common/rpc.py): after a server
restart a learner tries its server again within seconds, not gRPC's default of up to 120 s."""

from __future__ import annotations

import grpc

from common import rpc


def test_channels_bound_their_reconnect_backoff(monkeypatch) -> None:
    made: list[dict] = []

    def capture(target: str, *args, options=()) -> str:
        made.append(dict(options))
        return target

    monkeypatch.setattr(grpc, "insecure_channel", capture)
    monkeypatch.setattr(grpc, "secure_channel", capture)
    rpc.create_channel("127.0.0.1:1")
    rpc.create_channel("127.0.0.1:1", grpc.local_channel_credentials())
    assert len(made) == 2
    for options in made:
        assert options["grpc.max_reconnect_backoff_ms"] <= 2_000
        assert (
            options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]
        )
