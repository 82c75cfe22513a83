"""ALISE predictor service."""
