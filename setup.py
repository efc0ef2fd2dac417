"""Builds fp_dcp._cio from cio/cio.c, linked against liburing when its headers are present.

FP_DCP_WITHOUT_LIBURING=1 builds without io_uring (the threads engine is then
used); libxxhash (Debian's libxxhash-dev) gives the content hash of
incremental saves, and FP_DCP_WITHOUT_XXHASH=1 builds without it; ISA-L (Debian's
libisal-dev) gives the fastest CRC-32C, FP_DCP_WITHOUT_ISAL=1 builds without it; FP_DCP_WERROR=1 turns compiler warnings into errors (CI). The CUDA
sources in cuda/ (not a Python package) are copied into the built package as
fp_dcp/gpu/kernels/, so that wheels ship the kernels (gather, CRC-32C), and
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

_URING_PROBE = b"#include <liburing.h>\nint main(void) { struct io_uring r; return io_uring_queue_init(1, &r, 0); }\n"
_XXHASH_PROBE = (
    b"#include <xxhash.h>\n#if defined(__x86_64__)\n#include <xxh_x86dispatch.h>\n#endif\n"
    b"int main(void) { return (int)XXH3_128bits(0, 0).low64; }\n"
)
_ISAL_PROBE = b"#include <isa-l/crc.h>\nint main(void) { return (int)crc32_iscsi((unsigned char *)0, 0, 0); }\n"


def compiles(program: bytes, *flags: str) -> bool:
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    probe = subprocess.run([*cc, "-x", "c", "-", *flags, "-o", os.devnull], input=program, capture_output=True)
    return probe.returncode == 0


uring = os.environ.get("FP_DCP_WITHOUT_LIBURING") != "1" and compiles(_URING_PROBE, "-luring")
# libxxhash's dispatching entry points pick the widest vector unit at run time (twice SSE2's speed with AVX2).
xxhash = os.environ.get("FP_DCP_WITHOUT_XXHASH") != "1" and compiles(_XXHASH_PROBE, "-lxxhash")
# ISA-L's CRC-32C folds with carry-less multiplies: faster than the crc32 instruction on one core.
isal = os.environ.get("FP_DCP_WITHOUT_ISAL") != "1" and compiles(_ISAL_PROBE, "-lisal")
flags = ["-O2", "-std=gnu11", "-Wall", "-Wextra"]
if os.environ.get("FP_DCP_WERROR") == "1":
    flags.append("-Werror")

setup(
    cmdclass={"build_py": BuildWithKernels},
    ext_modules=[
        Extension(
            "fp_dcp._cio",
            sources=["cio/cio.c"],
            define_macros=[("FP_DCP_HAVE_LIBURING", "1")] * uring
            + [("FP_DCP_HAVE_XXHASH", "1")] * xxhash
            + [("FP_DCP_HAVE_ISAL", "1")] * isal,
            libraries=["uring"] * uring + ["xxhash"] * xxhash + ["isal"] * isal,
            extra_compile_args=flags,
        )
    ]
)
