"""ALISE executor service."""
