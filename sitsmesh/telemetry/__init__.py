"""What an SRE sees of each decision: counts, a sampled decision log, and traces."""
