"""The ``fp-dcp`` command's tools: inspect, verify, convert, bench, tune, plot; fio as the disk's reference.

Built on the public API.
"""
