"""Benchmarks (`alise bench ...`) and the live load generator; they import from services."""
