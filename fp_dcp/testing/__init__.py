"""Helpers for testing and benchmarking checkpoint code, shared by fp-dcp's tests and benchmarks.

As ``numpy.testing`` and ``torch.testing`` are for theirs: nothing in
fp-dcp itself imports this package, and importing it imports nothing (each
module is imported on its own, most of them import torch). The modules:

- ``processes``: child processes forked from a server that imported torch
  once (multiprocessing's forkserver), for ranks and trials;
- ``ranks``: a function run on N gloo ranks, with a deadline, every rank's
  result or error back to the caller;
- ``measure``: a quiet disk before a timed step, a step's seconds and
  CPU-seconds (device synchronized, rank barriers), GB/s of repeated runs;
- ``checkouts``: a benchmark's child run with this checkout's fp-dcp and a
  baseline's, for before-and-after ratios;
- ``states``: versioned state dicts whose every byte depends on the
  version, their digests, and comparing two state dicts bit for bit;
- ``llama``: Llama-shaped tensor names and shapes, modules and FSDP2-sharded
  models of them;
- ``tiers``: 4 ranks as 2 nodes on one machine, what each saves at a step,
  and a durable store slower than the saves;
- ``crash``: crash trials of a save (SIGKILL in every step, then a load);
- ``tier_crash``: crash trials of checkpoint tiers (a rank killed during
  replication or the drain, then a restore).
"""
