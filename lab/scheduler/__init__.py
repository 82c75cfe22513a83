"""Lab tools of services/scheduler."""
