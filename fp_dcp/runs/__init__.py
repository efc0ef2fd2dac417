"""Checkpointing inside a training loop: ``OverlappedCheckpointer``."""
