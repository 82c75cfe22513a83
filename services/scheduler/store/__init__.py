"""The scheduler's durable state in Redis: request records, token streams, the per-iteration
commit (one Lua script), and the full rewrite after Redis restarted."""
