"""Scheduling policies, one per file, registered by name."""
