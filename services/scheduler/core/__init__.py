"""Pure scheduling core: no torch, grpc, redis or asyncio (DESIGN.md section 4)."""
