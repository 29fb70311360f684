"""What production uses to talk to Triton: the gRPC client behind hot swaps and the reader of
its /metrics page behind backpressure."""
