"""Lab tools of services/predictor."""
