"""The wheel is what users install: it must hold the C extension and the gather kernel, and find the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    assert "fp_dcp/gpu/kernels/gather.cu" in names
    assert any(n.startswith("fp_dcp/_cio") and n.endswith(".so") for n in names), names
    assert not any(n.startswith("cuda/") for n in names)  # never a top-level package named cuda


def test_installed_wheel_finds_its_kernel(wheel, tmp_path):
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    probe = "import fp_dcp.gpu.gather as g; print(g.__file__); print(g.kernel_source())"
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
    module, kernel = run.stdout.split()
    assert module.startswith(str(site)), module  # the installed copy, not the source tree
    assert kernel == str(site / "fp_dcp" / "gpu" / "kernels" / "gather.cu")
    assert Path(kernel).read_bytes() == (ROOT / "cuda" / "gather.cu").read_bytes()
