"""Backpressure: per-stage pressure from real signals, admission decisions at the entry."""
