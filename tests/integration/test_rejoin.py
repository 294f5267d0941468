"""A plain server's learner across server restarts (in process, on one state dir): it joins
the server again as its only shard. After a restart that lost nothing it keeps its local
parameters for each fragment the server has not moved (its progress since the last merge)
and takes the server's values for a fragment its push moved; after a restart on an older
state dir (versions lost) it takes the server's state, with one log line."""

from __future__ import annotations

import logging
import shutil

import torch
from torch import nn

from common.retry import wait_until
from learner.api import DilocoSync

H = 4  # fragment 0 is pushed after steps 4, 8, 12 ..., fragment 1 after 2, 6, 10 ...
SERVER = {"fragments": 2, "mode": "sync", "lease_s": 30.0}  # no lease runs out meanwhile
# Generous: the machine may be busy; each wait ends as soon as its outcome holds.
WAIT_S = 60.0


class MLP(nn.Module):
    """Two blocks, so that the server splits the model into 2 fragments."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))


def learner(port: int, model: nn.Module) -> DilocoSync:
    settings = {"server": f"127.0.0.1:{port}", "learner_id": "a", "insecure": True}
    settings |= {"sync_every_steps": H, "overlap_steps": 1, "merge_alpha": 0.0}
    return DilocoSync(model, tokens_per_step=1, **settings)


def train(model: nn.Module, sync: DilocoSync, steps: int) -> None:
    """`steps` inner steps, each moving every parameter: local progress the merges take."""
    for _ in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        sync.step()


def local_fragment(model: nn.Module, sync: DilocoSync, fragment_id: int) -> list[torch.Tensor]:
    params = list(model.parameters())
    return [params[i].detach().clone() for i in sync.session.sync.replicas[fragment_id].indices]


def restart(start_service, service, state_dir):
    """Stop the server and start another on the same port from `state_dir`."""
    port = service.port
    service.stop(grace_s=0)
    return start_service(listen=f"127.0.0.1:{port}", state_dir=str(state_dir), **SERVER)


def notice_restart(sync: DilocoSync) -> None:
    """Until the learner has seen that the server lost its session: a heartbeat, as the
    heartbeat thread sends every lease_s / 3, answered NOT_FOUND by the new server."""

    def noticed() -> bool:
        sync.session.heartbeat.beat()  # fails while the channel reconnects: tried again
        return sync.shards_away == 1

    wait_until(noticed, WAIT_S, "the learner noting the lost session", interval_s=0.2)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_restart_that_lost_nothing_keeps_the_unmoved_fragments_local_progress(
    start_service, tmp_path
) -> None:
    state_dir = tmp_path / "state"
    service = start_service(state_dir=str(state_dir), **SERVER)
    model = MLP()
    with learner(service.port, model) as sync:
        train(model, sync, 2 * H)  # the push of fragment 0 after step 8 is out, not merged
        wait_until(lambda: service.aggregator.version(0) == 2, WAIT_S, "fragment 0's round")
        assert sync.versions == [1, 2]
        kept = local_fragment(model, sync, 1)  # trained on since its merge after step 7
        assert not same(kept, sync.session.sync.replicas[1].params)

        service = restart(start_service, service, state_dir)
        served = [service.aggregator.params(f) for f in (0, 1)]
        assert [service.aggregator.version(f) for f in (0, 1)] == [2, 2]  # none lost
        notice_restart(sync)
        assert sync.step() is True  # step 9 rejoins first: fragment 0 takes version 2
        assert sync.progress.rejoins == 1 and sync.shards_away == 0
        assert sync.versions == [2, 2]
        assert same(local_fragment(model, sync, 1), kept)  # not reset to the global value
        assert same(local_fragment(model, sync, 0), served[0])

        train(model, sync, 2)  # step 10 pushes fragment 1 to the restarted server
        assert sync.versions == [2, 3] and service.aggregator.version(1) == 3


def test_a_restart_on_an_older_state_dir_gives_the_learner_the_servers_state(
    start_service, tmp_path, caplog
) -> None:
    state_dir, older = tmp_path / "state", tmp_path / "older"
    service = start_service(state_dir=str(state_dir), **SERVER)
    model = MLP()
    with learner(service.port, model) as sync:
        train(model, sync, H + 1)  # both fragments at version 1, nothing in flight
        assert sync.versions == [1, 1]
        shutil.copytree(state_dir, older)  # no round closes meanwhile: a consistent copy
        train(model, sync, H)
        assert sync.versions == [2, 2]

        service = restart(start_service, service, older)
        served = [service.aggregator.params(f) for f in (0, 1)]
        assert [service.aggregator.version(f) for f in (0, 1)] == [1, 1]  # versions lost
        notice_restart(sync)
        with caplog.at_level(logging.WARNING, logger="diloco.learner"):
            assert sync.step() is True  # step 10 rejoins: both take the server's state
        assert sync.progress.rejoins == 1 and sync.versions == [1, 1]
        for fid in (0, 1):
            assert same(local_fragment(model, sync, fid), served[fid])
        (said,) = [r.getMessage() for r in caplog.records if "lost versions" in r.getMessage()]
        assert said.startswith("learner=a resyncing to the server's state")
        assert "fragment 0: server at version 1 is behind our 2" in said
        assert "fragment 1: server at version 1 is behind our 2" in said
