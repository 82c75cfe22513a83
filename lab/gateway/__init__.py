"""Lab tools of services/gateway."""
