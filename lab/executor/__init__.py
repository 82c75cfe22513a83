"""Lab tools of services/executor."""
