"""Which scheduler serves: the leader lease, running the service while it is held, and the
shards that own the registered executors."""
