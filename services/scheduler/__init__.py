"""ALISE scheduler service: Redis store, executor loops, gRPC servicer, simulator."""
