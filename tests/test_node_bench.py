"""benchmarks/node_bench.py's fio reference: N jobs at once, dealt over a target's directories, bytes summed."""

from __future__ import annotations

import os
import shutil

import pytest

from fp_dcp.testing.llama import share_of
from fp_dcp.tools.fio import Jobs
from fp_dcp.tools.workload import recycle
from fp_dcp.units import MiB

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (make system-deps does it)")


@needs_fio
def test_fio_jobs_write_a_file_each_dealt_over_the_directories_and_report_every_jobs_bytes(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    jobs = Jobs(depth=2, block=MiB, jobs=4, direct=False)  # buffered: any filesystem takes it
    assert "--direct=0" in jobs.args("x", "write", MiB) and "--direct=1" not in jobs.args("x", "write", MiB)
    wrote = jobs.run(":".join(map(str, dirs)), "write", 2 * MiB)
    assert wrote.bytes == 4 * 2 * MiB
    assert sorted(os.listdir(dirs[0])) == ["fio.0", "fio.2"]
    assert sorted(os.listdir(dirs[1])) == ["fio.1", "fio.3"]
    assert all(os.path.getsize(d / n) == 2 * MiB for d in dirs for n in os.listdir(d))
    read = jobs.run(":".join(map(str, dirs)), "read", 2 * MiB)
    assert read.bytes == 4 * 2 * MiB and read.seconds > 0


def test_one_ranks_share_is_fsdp2s_first_and_largest_chunk_of_dim_0():
    assert share_of({"w": (10, 3), "norm": (8,)}, 4) == {"w": (3, 3), "norm": (2,)}


def test_fio_allocates_files_off_its_clock_only_where_asked():
    """On tmpfs a layout's fallocate allocates every page, off fio's clock: node_bench turns it off there."""
    assert not any(a.startswith("--fallocate") for a in Jobs(jobs=2).args("d", "write", MiB))
    assert "--fallocate=none" in Jobs(jobs=2, direct=False, allocate_first=False).args("d", "write", MiB)


def test_recycling_a_target_leaves_it_as_it_was(tmp_path):
    (tmp_path / "kept").write_bytes(b"x")
    recycle(str(tmp_path), 3 * MiB, "recycled.1")
    assert os.listdir(tmp_path) == ["kept"]
