"""The wheel is what users install: it must hold the C extension and the CUDA kernels, and find the kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted(p.name for p in (ROOT / "cuda").glob("*.cu"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr
    (found,) = out.glob("fp_dcp-*.whl")
    return found


def test_wheel_holds_the_extension_and_the_kernel(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {"gather.cu", "crc32c.cu"} <= set(KERNELS)
    assert all(f"fp_dcp/gpu/kernels/{kernel}" in names for kernel in KERNELS), names
    assert any(n.startswith("fp_dcp/_cio") and n.endswith(".so") for n in names), names
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
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"],
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


def test_a_wheel_built_from_the_sdist_is_complete(tmp_path):
    # Users installing from PyPI's sdist build the wheel there: everything build_py copies must be in it.
    sdist = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert sdist.returncode == 0, sdist.stderr
    (archive,) = tmp_path.glob("fp_dcp-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    (source,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("fp_dcp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fp_dcp_default_storage.pth" in names
    assert all(f"fp_dcp/gpu/kernels/{kernel}" in names for kernel in KERNELS), names
