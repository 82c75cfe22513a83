"""The `alise` command: the serving commands (services/main.py) and, where they are
installed, the simulator's and the benchmarks' groups and the lab's additions to the
services' groups (`alise predictor calibrate`, `alise executor stub`, ...)."""
