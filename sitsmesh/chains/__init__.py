"""Latency chains: Envoy access logs and stage reports -> one chain per request."""
