"""The ``fp-dcp`` command's tools: inspect, verify, convert, bench, tune, plot; built on the public API."""
