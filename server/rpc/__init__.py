"""The aggregator as a gRPC service: the servicer, who may call (auth), what one caller may
hold (limits, calls), how a push's bytes are received (receive), the metrics, and the running
service with its process settings (service)."""
