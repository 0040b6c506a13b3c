"""Training side: the versioned train step, the attribution audit, checkpoints."""
