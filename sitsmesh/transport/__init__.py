"""gRPC edge: thin servicers that translate protobuf to domain calls and back."""
