"""A machine without the system's liburing, ISA-L and libxxhash, for checking what a wheel carries.

``hiding_system_libraries(command)`` runs a command in a mount namespace of its own in which every copy of those
libraries the dynamic loader knows of (``ldconfig -p``) reads as an empty file, as on a node or container image
without Debian's liburing2, libisal2 and libxxhash0; the rest of the machine is untouched. It needs root (CI runs
as root) and ``unshare`` from util-linux.

Run as a script (``make wheel`` does, for each wheel it made), it loads a wheel's native module on that machine with
the Python the wheel is for, without importing fp_dcp (so without torch, which only one Python here has), and
checks that every optional library is linked and comes from the wheel's own ``fp_dcp.libs`` (without root, with the
system's copies in place, which the wheel's must still win over):

    python tests/wheel_check.py PYTHON WHEEL
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

LINKS = ("uring", "isal", "xxhash")  # fp_dcp/_native/libraries.py's Library.link of each


def system_copies() -> list[str]:
    """The files behind every name the loader resolves for the three libraries, symlinks followed."""
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in listing.splitlines():
        name, _, path = line.strip().partition(" => ")
        if any(name.startswith(f"lib{link}.so") for link in LINKS):
            found.add(os.path.realpath(path))
    return sorted(found)


def can_hide() -> str | None:
    """Why the system's copies cannot be hidden here, or None."""
    if os.geteuid() != 0:
        return "hiding the system's libraries needs root (a mount namespace)"
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        return "unshare --mount is refused here"
    return None


def hiding_system_libraries(command: Sequence[str]) -> list[str]:
    """``command``, run where the system's copies of the three libraries are empty files."""
    mounts = " && ".join(f"mount --bind /dev/null {shlex.quote(path)}" for path in system_copies()) or "true"
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh", *command]


# Loaded by file, as the package's own import would, but without fp_dcp/__init__.py and so without torch.
_PROBE = """
import ctypes, importlib.machinery, importlib.util, json, sys
path, hidden = sys.argv[1], sys.argv[2] == "hidden"
for soname in ("liburing.so.2", "libisal.so.2", "libxxhash.so.0") if hidden else ():
    try:
        ctypes.CDLL(soname)
    except OSError:
        continue
    sys.exit(f"{soname} still loads from the system: the libraries are not hidden")
loader = importlib.machinery.ExtensionFileLoader("_cio", path)
spec = importlib.util.spec_from_file_location("_cio", path, loader=loader)
cio = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cio)
ring = cio.Ring(8)
maps = open("/proc/self/maps").read().split()
print(json.dumps({
    "linked": list(cio.LINKED_LIBRARIES),
    "crc32c_engine": cio.CRC32C_ENGINE,
    "hash": cio.Hash128().hexdigest() if hasattr(cio, "Hash128") else None,
    "loaded": sorted({m.rsplit("/", 2)[-2] + "/" + m.rsplit("/", 1)[-1] for m in maps if "/fp_dcp.libs/" in m}),
}))
"""


def check(python: str, wheel: Path, hide: bool = True) -> str:
    """What the wheel's native module reports, on a machine without the system's libraries where ``hide``; raises
    if it lacks one of them or loads one from anywhere but the wheel."""
    with tempfile.TemporaryDirectory() as unpacked:
        zipfile.ZipFile(wheel).extractall(unpacked)
        (module,) = Path(unpacked, "fp_dcp", "_native").glob("_cio.*.so")
        command = [python, "-I", "-c", _PROBE, str(module), "hidden" if hide else "visible"]
        run = subprocess.run(hiding_system_libraries(command) if hide else command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{wheel.name} with {python}: {run.stderr.strip()}")
    report = run.stdout.strip()
    if not all(f"fp_dcp.libs/lib{link}-" in report for link in LINKS) or '"isa-l"' not in report:
        raise RuntimeError(f"{wheel.name} with {python}: a library is missing or not the wheel's own: {report}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("python")
    parser.add_argument("wheel", type=Path)
    args = parser.parse_args()
    reason = can_hide()
    if reason is not None:
        print(f"wheel_check: {reason}: checking with the system's copies in place", file=sys.stderr)
    print(f"{args.wheel.name} ({args.python}): {check(args.python, args.wheel, hide=reason is None)}")


if __name__ == "__main__":
    main()
