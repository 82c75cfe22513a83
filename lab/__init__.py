"""The lab: evaluation, calibration, tuning, baselines, kernel and quality checks, test
helpers and the simulator's CLI. Serving code (services/) never imports it."""
