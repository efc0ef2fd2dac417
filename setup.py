"""Builds fp_dcp._cio from cio/cio.c, linked against liburing when its headers are present.

FP_DCP_WITHOUT_LIBURING=1 builds without io_uring (the threads engine is then
used); FP_DCP_WERROR=1 turns compiler warnings into errors (CI). The CUDA
sources in cuda/ (not a Python package) are copied into the built package as
fp_dcp/gpu/kernels/, so that wheels ship the gather kernel, and
fp_dcp_default_storage.pth goes beside the package, so that
FP_DCP_DEFAULT_STORAGE=1 reaches processes that never import fp_dcp
(fp_dcp.integrations.default_storage).
"""

import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "cuda"
STARTUP_HOOK = "fp_dcp_default_storage.pth"


class BuildWithKernels(build_py):
    def run(self) -> None:
        super().run()
        shutil.copyfile(ROOT / STARTUP_HOOK, Path(self.build_lib) / STARTUP_HOOK)
        target = Path(self.build_lib) / "fp_dcp" / "gpu" / "kernels"
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted(KERNELS.glob("*.cu")):
            shutil.copyfile(source, target / source.name)

_PROBE = b"#include <liburing.h>\nint main(void) { struct io_uring r; return io_uring_queue_init(1, &r, 0); }\n"


def have_liburing() -> bool:
    if os.environ.get("FP_DCP_WITHOUT_LIBURING") == "1":
        return False
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    probe = subprocess.run([*cc, "-x", "c", "-", "-luring", "-o", os.devnull], input=_PROBE, capture_output=True)
    return probe.returncode == 0


uring = have_liburing()
flags = ["-O2", "-std=gnu11", "-Wall", "-Wextra"]
if os.environ.get("FP_DCP_WERROR") == "1":
    flags.append("-Werror")

setup(
    cmdclass={"build_py": BuildWithKernels},
    ext_modules=[
        Extension(
            "fp_dcp._cio",
            sources=["cio/cio.c"],
            define_macros=[("FP_DCP_HAVE_LIBURING", "1")] if uring else [],
            libraries=["uring"] if uring else [],
            extra_compile_args=flags,
        )
    ]
)
