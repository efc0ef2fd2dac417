"""Builds fp_dcp._native._cio from cio/*.c, linked against each optional library whose headers are present.

The libraries (liburing for the io_uring engine, ISA-L for the fastest CRC-32C,
libxxhash for incremental saves' content hash), what each costs when absent
and the variable that builds without it (FP_DCP_WITHOUT_LIBURING, ...) are in
fp_dcp/_native/libraries.py; the build ends by saying which it linked and
warning of each it could not. FP_DCP_WERROR=1 turns compiler warnings into
errors (CI). `make wheel` makes manylinux wheels that carry the libraries
(docs/install.md). The CUDA
sources in cuda/ (not a Python package) are copied into the built package as
fp_dcp/gpu/kernels/, so that wheels ship the kernels (gather, CRC-32C), and
fp_dcp_default_storage.pth goes beside the package, so that
FP_DCP_DEFAULT_STORAGE=1 reaches processes that never import fp_dcp
(fp_dcp.integrations.default_storage).
"""

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "cuda"
NATIVE = ROOT / "cio"
STARTUP_HOOK = "fp_dcp_default_storage.pth"


class BuildWithKernels(build_py):
    def run(self) -> None:
        super().run()
        shutil.copyfile(ROOT / STARTUP_HOOK, Path(self.build_lib) / STARTUP_HOOK)
        target = Path(self.build_lib) / "fp_dcp" / "gpu" / "kernels"
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted(KERNELS.glob("*.cu")):
            shutil.copyfile(source, target / source.name)


def load_libraries():
    """fp_dcp/_native/libraries.py, loaded by path: the package cannot be imported before it is built."""
    spec = importlib.util.spec_from_file_location("fp_dcp_libraries", ROOT / "fp_dcp" / "_native" / "libraries.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.LIBRARIES


# A program that compiles and links against each library: its headers and its shared object are both there.
PROBES = {
    "liburing": b"#include <liburing.h>\nint main(void) { struct io_uring r; return io_uring_queue_init(1, &r, 0); }\n",
    # libxxhash's dispatching entry points pick the widest vector unit at run time (twice SSE2's speed with AVX2).
    "libxxhash": (
        b"#include <xxhash.h>\n#if defined(__x86_64__)\n#include <xxh_x86dispatch.h>\n#endif\n"
        b"int main(void) { return (int)XXH3_128bits(0, 0).low64; }\n"
    ),
    "isa-l": b"#include <isa-l/crc.h>\nint main(void) { return (int)crc32_iscsi((unsigned char *)0, 0, 0); }\n",
}
MACROS = {"liburing": "FP_DCP_HAVE_LIBURING", "libxxhash": "FP_DCP_HAVE_XXHASH", "isa-l": "FP_DCP_HAVE_ISAL"}


def compiles(program: bytes, *flags: str) -> bool:
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    probe = subprocess.run([*cc, "-x", "c", "-", *flags, "-o", os.devnull], input=program, capture_output=True)
    return probe.returncode == 0


LIBRARIES = load_libraries()
LINKED = [
    library
    for library in LIBRARIES
    if os.environ.get(library.opt_out) != "1" and compiles(PROBES[library.name], f"-l{library.link}")
]


class BuildAndReport(build_ext):
    """The build ends by saying what it linked and, as a warning, what each library it could not link costs."""

    def run(self) -> None:
        super().run()
        linked = {library.name for library in LINKED}
        report = ", ".join(f"{library.name} {'yes' if library.name in linked else 'NO'}" for library in LIBRARIES)
        print(f"fp-dcp native build: {report}", file=sys.stderr)
        for library in LIBRARIES:
            if library.name not in linked:
                print(f"warning: {library.absence()}", file=sys.stderr)


flags = ["-O2", "-std=gnu11", "-Wall", "-Wextra"]
if os.environ.get("FP_DCP_WERROR") == "1":
    flags.append("-Werror")

setup(
    cmdclass={"build_py": BuildWithKernels, "build_ext": BuildAndReport},
    ext_modules=[
        Extension(
            "fp_dcp._native._cio",
            sources=sorted(f"cio/{source.name}" for source in NATIVE.glob("*.c")),
            depends=sorted(f"cio/{header.name}" for header in NATIVE.glob("*.h")),
            define_macros=[(MACROS[library.name], "1") for library in LINKED],
            libraries=[library.link for library in LINKED],
            extra_compile_args=flags,
        )
    ],
)
