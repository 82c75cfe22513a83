"""Generated protobuf and gRPC stubs (do not edit; run `make proto`)."""
