"""The save side: ``FastPersistWriter`` (DCP's ``StorageWriter``), its write pipeline, planner, placement and commit."""
