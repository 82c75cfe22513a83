"""ALISE serving system: gateway, predictor, scheduler and executor services."""
