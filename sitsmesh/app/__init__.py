"""The `sitsmesh serve` process: listeners, worker processes, the composition root, the
metrics registry, preflight checks and the admin token."""
