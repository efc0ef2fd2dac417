"""Start-up hooks for the torch DCP suite runs; ``run.py`` puts this directory on ``PYTHONPATH``.

Being a ``sitecustomize`` module, this runs at interpreter start-up in pytest
and in every Python process the tests start (``MultiProcessTestCase``
workers, DCP's checkpoint process), before any test module imports
``torch.distributed.checkpoint``. Without the variables below it does nothing.

- ``FP_DCP_TORCH_SUITE_SHIM=1``: loads ``../shim.py`` (fp-dcp in place of
  torch's ``FileSystemWriter`` / ``FileSystemReader``).
- ``FP_DCP_TORCH_SUITE_GPU_TESTS_ON_CPU=1`` (``run.py --gpu-tests-on-cpu``, set
  for the baseline and the shim run alike): ``skip_if_lt_x_gpu(n)`` lets the
  test run without accelerators (its own ``allow_cpu=True``), so the tests that
  only use ``self.device_type`` run on CPU with gloo; those that call
  ``.cuda()`` or need NCCL then fail in both runs.
"""

from __future__ import annotations

import os

if os.environ.get("FP_DCP_TORCH_SUITE_GPU_TESTS_ON_CPU") == "1":
    import functools

    import torch.testing._internal.common_distributed as _common_distributed

    _skip_if_lt_x_gpu = _common_distributed.skip_if_lt_x_gpu

    @functools.wraps(_skip_if_lt_x_gpu)
    def _skip_if_lt_x_gpu_allow_cpu(x, *, allow_cpu=True):  # type: ignore[no-untyped-def]
        return _skip_if_lt_x_gpu(x, allow_cpu=True)

    _common_distributed.skip_if_lt_x_gpu = _skip_if_lt_x_gpu_allow_cpu

if os.environ.get("FP_DCP_TORCH_SUITE_SHIM") == "1":
    import importlib.util
    import sys

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shim.py")
    _spec = importlib.util.spec_from_file_location("fp_dcp_torch_suite_shim", _path)
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _module
    _spec.loader.exec_module(_module)
