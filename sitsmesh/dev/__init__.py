"""Local stacks for `make run`, the integration tests and the benchmarks: Envoy bootstraps,
the demo Triton model, and launchers for real Envoy, Triton, Redis and sitsmesh processes.
Nothing in production imports this package."""
