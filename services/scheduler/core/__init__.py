"""Pure scheduling core: no torch, grpc, redis, asyncio or numpy (see docs/scheduling.md)."""
