"""fp-dcp in code that calls DCP without naming a storage: ``install`` for path-only calls, framework recipes."""
