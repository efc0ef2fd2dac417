"""The loaders safetensors_bench.py measures fp-dcp against, each filling a state dict of targets.

Every loader is made anew for each load and leaves the tensors it read in
the targets, as a model's parameters get them: DCP's readers load into them;
the safetensors package, Run:ai's model streamer and fastsafetensors hand out
tensors of their own, copied into the targets as vLLM's weight loaders copy
them (``param.copy_(tensor)``), which is part of the load's time.

- ``HuggingFaceStorageReader`` (torch), ``thread_count`` 1 and 4;
- ``safetensors.torch.load_file`` per file, onto the targets' device;
- runai-model-streamer's ``SafetensorsStreamer`` (``stream_files`` of every
  file to host memory, then ``get_tensors``), its defaults (what vLLM's
  ``--load-format runai_streamer`` uses; ``RUNAI_STREAMER_CONCURRENCY`` and
  ``RUNAI_STREAMER_MEMORY_LIMIT`` tune it);
- fastsafetensors' ``SafeTensorsFileLoader`` with ``nogds=True`` (no GPUDirect
  Storage: reads into host buffers, then to the device), onto the targets'
  device, as vLLM's ``--load-format fastsafetensors`` calls it.

The peers are the benchmark's, not fp-dcp's: ``pip install -r
benchmarks/requirements-safetensors.txt`` in the environment that runs it.
One that is not installed is reported as such and left out.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistReader, LoadSummary

Targets = dict[str, torch.Tensor]
Loader = Callable[[Targets], None]
INSTALL = "pip install -r benchmarks/requirements-safetensors.txt"
RUNAI = "runai-model-streamer"
FASTSAFETENSORS = "fastsafetensors (no GDS)"
_MODULES = {RUNAI: "runai_model_streamer", FASTSAFETENSORS: "fastsafetensors"}


class FpDcpLoad:
    """fp-dcp's load, a reader made anew each time, as users make one; ``last``: that reader's ``LoadSummary``
    (how many of its bytes went through the staging buffers)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.last: LoadSummary | None = None

    def __call__(self, target: Targets) -> None:
        reader = FastPersistReader(self.directory)
        dcp.load(target, storage_reader=reader, no_dist=True)
        self.last = reader.last_load


def loaders(directory: str, files: list[str], device: str) -> tuple[dict[str, Loader], dict[str, str]]:
    """Every loader of the comparison by name, and those left out with the reason."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    def hf(threads: int) -> Loader:
        def load(target: Targets) -> None:
            dcp.load(target, storage_reader=HuggingFaceStorageReader(directory, threads), no_dist=True)

        return load

    def whole_files(target: Targets) -> None:
        for path in files:
            for name, tensor in load_file(path, device=device).items():
                target[name].copy_(tensor)

    found: dict[str, Loader] = {
        "fp-dcp": FpDcpLoad(directory),
        "HuggingFaceStorageReader t=1": hf(1),
        "HuggingFaceStorageReader t=4": hf(4),
        "safetensors load_file": whole_files,
    }
    missing = {}
    for name, module in _MODULES.items():
        if importlib.util.find_spec(module) is None:
            missing[name] = f"not installed ({INSTALL})"
        else:
            found[name] = runai(files) if name == RUNAI else fastsafetensors(files, device)
    return found, missing


def runai(files: list[str]) -> Loader:
    from runai_model_streamer import SafetensorsStreamer

    def load(target: Targets) -> None:
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            for name, tensor in streamer.get_tensors():
                target[name].copy_(tensor)

    return load


def fastsafetensors(files: list[str], device: str) -> Loader:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    where = "cuda:0" if device == "cuda" else device

    def load(target: Targets) -> None:
        loader = SafeTensorsFileLoader(SingleGroup(), device=where, nogds=True)
        try:
            loader.add_filenames({0: files})
            buffers = loader.copy_files_to_device()
            try:
                for name in loader.get_keys():
                    target[name].copy_(buffers.get_tensor(name))
            finally:
                buffers.close()
        finally:
            loader.close()

    return load
