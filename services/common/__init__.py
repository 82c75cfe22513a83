"""Shared infrastructure: settings, logging, metrics, gRPC helpers, embedded Redis, stubs."""
