"""Optional OpenTelemetry traces, off unless a daemon's main() turns them on.

    init_tracing("otlp", "http://127.0.0.1:4317", "diloco-server")  # once, from main()
    with span("diloco.push", fragment=3) as traced:
        traced.set_attribute("result", "accepted")

Off, `span` returns one shared do-nothing context and opentelemetry is never imported: the
core install does without it, and the `otel` extra brings it. Spans go to this module's own
tracer, not OpenTelemetry's global provider, so that tests can swap providers (use_provider,
trace_in_memory) and a library in the same process sees no provider set on its behalf.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for the annotations only: importing them would load the SDK
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

EXPORTERS = ("console", "otlp")
OTEL_EXTRA = "pip install 'decoupled-diloco[otel]'"
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"


class _NullSpan:
    """What `span` gives with tracing off: takes attributes and drops them. One instance
    serves every call, so that an untraced push or round close allocates nothing for it."""

    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def is_recording(self) -> bool:
        """False: a caller skips work whose only use is an attribute."""
        return False


NULL_SPAN = _NullSpan()
_tracer: Any = None  # an opentelemetry Tracer while tracing is on


def span(name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A span named `name` around the `with` block, current while it runs, yielding an object
    with set_attribute / set_attributes / is_recording. An exception leaving the block is
    recorded on the span, which is marked as an error. Tracing off: NULL_SPAN."""
    if _tracer is None:
        return NULL_SPAN
    return _tracer.start_as_current_span(name, attributes=attributes)


def use_provider(provider: TracerProvider | None) -> None:
    """Send every later span to `provider`'s processors; None turns tracing off."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer("diloco")


def init_tracing(exporter: str, endpoint: str, service_name: str) -> TracerProvider:
    """Trace from now on, batching spans to `exporter`: "console" (stdout, to try it) or "otlp"
    (an OpenTelemetry collector at `endpoint`; http:// is plaintext, https:// TLS), each span
    tagged with `service_name`. Called once, from main(); the provider flushes its last spans
    at interpreter exit. A missing package is a ValueError that names it, raised here so that
    the daemon stops at startup, not at its first span."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as err:
        raise ValueError(
            f"trace_exporter {exporter!r} needs the OpenTelemetry SDK: {OTEL_EXTRA}"
        ) from err
    if exporter == "console":
        span_exporter = ConsoleSpanExporter()
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as err:
            raise ValueError(
                f"trace_exporter 'otlp' needs the package {OTLP_PACKAGE}: {OTEL_EXTRA}"
            ) from err
        span_exporter = OTLPSpanExporter(endpoint=endpoint)
    else:
        raise ValueError(f"trace_exporter must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    use_provider(provider)
    return provider


def trace_in_memory() -> InMemorySpanExporter:
    """For tests: record every later span in memory, synchronously; the returned exporter's
    get_finished_spans() lists them. use_provider(None) turns tracing off again."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    use_provider(provider)
    return exporter
