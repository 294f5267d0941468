"""The aggregator as a gRPC service: the servicer, who may call (auth), what one caller may
hold (limits, calls), how a push's bytes are received (receive), and the metrics.
The running service and its process settings are in server/main.py."""
