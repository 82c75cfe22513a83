"""ALISE gateway service."""
