"""State shared by every replica and worker process through Redis."""
