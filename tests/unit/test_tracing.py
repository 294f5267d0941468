"""Optional traces: off, `span` costs one shared object and opentelemetry stays unimported;
on, a push and a round close each leave a span with what a reader of the trace needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.codec.fragment import encode_fragment
from common.tracing import (
    NULL_SPAN,
    OTEL_EXTRA,
    OTLP_PACKAGE,
    init_tracing,
    span,
    trace_in_memory,
    use_provider,
)
from server.aggregator import Aggregator
from server.config import ObservabilityConfig, aggregator_config
from server.rpc.servicer import AggregatorServicer
from tests.support.fakes import FINGERPRINT, SHAPES, FakeClock, tensors
from tests.support.fuzz.world import FakeContext, push_messages

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def spans():
    """Spans recorded in memory for the test; tracing off again afterwards."""
    exporter = trace_in_memory()
    yield exporter
    use_provider(None)


def finished(exporter, name: str) -> list[dict]:
    return [dict(s.attributes) for s in exporter.get_finished_spans() if s.name == name]


def test_off_span_is_the_shared_null_context_and_opentelemetry_is_not_imported() -> None:
    script = (
        "import sys\n"
        "import server.main\n"
        "from common.tracing import NULL_SPAN, span\n"
        "with span('diloco.push', fragment=0) as traced:\n"
        "    traced.set_attribute('result', 'accepted')\n"
        "assert span('x') is NULL_SPAN and traced is NULL_SPAN and not traced.is_recording()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry'))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_a_round_close_is_one_span_with_its_summary(spans) -> None:
    config = aggregator_config(outer_lr=1.0, outer_momentum=0.0, pull_codec="fp32")
    agg = Aggregator(config, FakeClock())
    a, b = (agg.join(name, FINGERPRINT).session_id for name in ("a", "b"))
    agg.initialize(a, 0, tensors(0))

    agg.push(a, 0, 0, tensors(1), tokens=100, inner_steps=10)
    assert finished(spans, "diloco.round_close") == []  # b has not pushed: the round stays open
    agg.push(b, 0, 0, tensors(2), tokens=300, inner_steps=10)

    (closed,) = finished(spans, "diloco.round_close")
    assert closed["fragment"] == 0 and closed["version"] == 1
    assert closed["contributors"] == 2 and closed["tokens"] == 400
    assert closed["outer_step_s"] >= 0.0


def test_a_push_is_one_span_with_who_sent_what_and_the_result(spans) -> None:
    agg = Aggregator(aggregator_config(mode="quorum", min_contributors=2), FakeClock())
    servicer = AggregatorServicer(agg)
    session = agg.join("a", FINGERPRINT).session_id
    agg.initialize(session, 0, tensors(0))
    delta = encode_fragment([torch.full(s, 1e-3) for s in SHAPES], "fp32")

    servicer.PushFragment(iter(push_messages(session, 0, 0, delta)), FakeContext())
    with pytest.raises(Exception, match="ALREADY_EXISTS"):  # the same push again: refused
        servicer.PushFragment(iter(push_messages(session, 0, 0, delta)), FakeContext())

    accepted, refused = finished(spans, "diloco.push")
    expected = dict(learner="a", fragment=0, base_version=0, bytes=len(delta))
    assert accepted == {**expected, "result": "accepted"}
    assert refused == {**expected, "result": "ALREADY_EXISTS"}


@pytest.mark.parametrize(
    "exporter, endpoint, named",
    [
        ("jaeger", "", "trace_exporter must be empty (off) or one of console, otlp, got 'jaeger'"),
        ("otlp", "", "trace_exporter otlp needs trace_endpoint"),
        ("console", "http://127.0.0.1:4317", "trace_endpoint is for trace_exporter otlp"),
        ("otlp", "127.0.0.1:4317", "the collector's http(s):// URL"),
    ],
)
def test_bad_trace_settings_name_the_setting(exporter, endpoint, named) -> None:
    with pytest.raises(ValueError) as err:
        ObservabilityConfig(trace_exporter=exporter, trace_endpoint=endpoint)
    assert named in str(err.value)


def test_good_trace_settings_start_tracing() -> None:
    ObservabilityConfig(trace_exporter="otlp", trace_endpoint="http://127.0.0.1:4317")
    for exporter in ("console", "otlp"):
        provider = init_tracing(exporter, "http://127.0.0.1:4317", "diloco-test")
        try:
            assert span("diloco.push") is not NULL_SPAN
        finally:
            use_provider(None)
            provider.shutdown()


@pytest.mark.parametrize(
    "missing, named",
    [
        ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", OTLP_PACKAGE),
        ("opentelemetry.sdk.resources", OTEL_EXTRA),
    ],
)
def test_a_missing_package_is_one_error_naming_it(monkeypatch, missing, named) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # its import fails, as when not installed
    with pytest.raises(ValueError) as err:
        init_tracing("otlp", "http://127.0.0.1:4317", "diloco-test")
    assert named in str(err.value)
    assert span("diloco.push") is NULL_SPAN
