"""The load side: ``FastPersistReader`` (DCP's ``StorageReader``), its read pipeline, and ``verify_checkpoint``."""
