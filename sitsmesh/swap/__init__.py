"""Triton model hot swaps: load, warm, verify, promote, drain, retire; rollback on failure."""
