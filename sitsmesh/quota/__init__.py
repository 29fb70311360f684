"""Quotas Envoy enforces itself (RLQS): what each Envoy may admit, decided here."""
