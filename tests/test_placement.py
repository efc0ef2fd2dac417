"""data_dirs and lanes: data files spread over several directories, found again by the reader."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import failure, load, save
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import (
    CorruptCheckpointError,
    FastPersistReader,
    FastPersistWriter,
    IOConfig,
    NotACheckpointError,
    verify_checkpoint,
)
from fp_dcp.io.device import filesystem_of
from fp_dcp.io.engine import Engine
from fp_dcp.io.files import kernel_copies
from fp_dcp.save import placement
from fp_dcp.save.placement import LANE_BYTES, auto_lanes, planned_bytes


def state_of(value: float) -> dict:
    return {f"w{i}": torch.full((100 + i, 64), value + i) for i in range(12)}


def assert_loads(path, value, **kwargs) -> None:
    target = {k: torch.zeros_like(v) for k, v in state_of(0).items()}
    load(target, path, **kwargs)
    for k, v in state_of(value).items():
        assert torch.equal(target[k], v), k


def data_files(directory) -> list:
    return sorted(p.name for p in directory.rglob("*.distcp"))


def test_files_are_striped_over_data_dirs_and_lanes(tmp_path):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    writer = save(state_of(1), tmp_path / "step-1", data_dirs=dirs, lanes_per_dir=2)
    assert len(writer.last_save.files) == 4
    assert data_files(tmp_path / "step-1") == []  # only .metadata and .lock there
    (sub0,) = dirs[0].iterdir()
    (sub1,) = dirs[1].iterdir()
    assert sub0.name == sub1.name and sub0.name.startswith("step-1-")
    assert len(data_files(sub0)) == 2 and len(data_files(sub1)) == 2
    assert_loads(tmp_path / "step-1", 1, data_dirs=dirs)


def test_reader_finds_the_data_dirs_or_names_what_is_missing(tmp_path):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    save(state_of(2), tmp_path / "ckpt", data_dirs=dirs)
    assert_loads(tmp_path / "ckpt", 2)  # where the save put them: no need to be told
    moved = tmp_path / "mnt" / "nvme1"
    moved.parent.mkdir()
    shutil.move(dirs[1], moved)
    with pytest.raises(CheckpointException) as e:
        assert_loads(tmp_path / "ckpt", 2)  # not where the save put it, not beside the checkpoint
    err = failure(e)
    assert isinstance(err, CorruptCheckpointError) and "missing" in str(err) and str(dirs[1]) in str(err)
    with pytest.raises(NotACheckpointError, match="pass that many directories as data_dirs="):
        FastPersistReader(tmp_path / "ckpt", data_dirs=dirs[:1]).read_metadata()
    with pytest.raises(CorruptCheckpointError, match=r"data directory .*nvme1 \(data_dirs\[1\]\) is missing"):
        FastPersistReader(tmp_path / "ckpt", data_dirs=dirs).read_metadata()
    assert_loads(tmp_path / "ckpt", 2, data_dirs=[dirs[0], moved])  # mounted elsewhere, same order
    (lost,) = list((moved).rglob("*.distcp"))
    lost.unlink()
    with pytest.raises(CheckpointException) as e:
        assert_loads(tmp_path / "ckpt", 2, data_dirs=[dirs[0], moved])
    err = failure(e)
    assert isinstance(err, CorruptCheckpointError) and "missing" in str(err) and lost.name in str(err)


@pytest.mark.parametrize("layout", ["plain", "lanes", "data_dirs"])
def test_a_checkpoint_copied_elsewhere_loads_without_being_told(tmp_path, layout):
    """Relocation: a run's tree copied (or mounted) elsewhere as a whole, the original gone."""
    run = tmp_path / "run"
    kwargs = {
        "plain": {},
        "lanes": {"lanes_per_dir": 3},
        "data_dirs": {"data_dirs": [run / "nvme0", run / "nvme1"], "lanes_per_dir": 2},
    }[layout]
    save(state_of(5), run / "ckpt", **kwargs)
    shutil.copytree(run, tmp_path / "elsewhere")
    shutil.rmtree(run)
    assert_loads(tmp_path / "elsewhere" / "ckpt", 5)
    assert verify_checkpoint(tmp_path / "elsewhere" / "ckpt").ok


def test_data_files_gathered_beside_the_metadata_are_found(tmp_path):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    save(state_of(6), tmp_path / "ckpt", data_dirs=dirs, lanes_per_dir=2)
    for f in [f for d in dirs for f in d.rglob("*.distcp")]:
        shutil.move(f, tmp_path / "ckpt" / f.name)
    for d in dirs:
        shutil.rmtree(d)
    assert_loads(tmp_path / "ckpt", 6)
    assert verify_checkpoint(tmp_path / "ckpt").ok


def test_checkpoints_sharing_data_dirs_keep_their_own_files(tmp_path):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    save(state_of(1), tmp_path / "step-1", data_dirs=dirs)
    save(state_of(2), tmp_path / "step-2", data_dirs=dirs)
    save(state_of(3), tmp_path / "step-1", data_dirs=dirs).close()  # overwrite step-1 only; close: old files gone
    assert_loads(tmp_path / "step-1", 3, data_dirs=dirs)
    assert_loads(tmp_path / "step-2", 2, data_dirs=dirs)
    assert len(data_files(tmp_path / "nvme0")) == 2  # one file per checkpoint: the replaced one is gone


def test_duplicate_data_dirs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        save(state_of(1), tmp_path / "c", data_dirs=[tmp_path / "a", tmp_path / "a"])


@pytest.mark.parametrize(("threads", "data_dirs", "files"), [(1, 0, 2), (2, 0, 4), (8, 0, 8), (2, 3, 6)])
def test_auto_lanes_write_several_files_where_the_page_cache_copies(tmp_path, monkeypatch, threads, data_dirs, files):
    """Writes into one file through the page cache are copied one at a time: auto gives a rank twice its host
    threads' worth of files (at most 8), at least one per directory, and two staging buffers for each."""
    monkeypatch.setattr(placement, "LANE_BYTES", 1024)  # a file for every KiB: this small state gets them all
    dirs = [tmp_path / f"d{i}" for i in range(data_dirs)] or None
    config = IOConfig(direct_io=False, host_threads=threads)
    writer = save(state_of(3), tmp_path / "ckpt", data_dirs=dirs, config=config)
    assert len(writer.last_save.files) == files
    assert writer._resources.io.context().pool.count >= 2 * files
    assert_loads(tmp_path / "ckpt", 3, data_dirs=dirs)


def test_large_items_are_written_in_turn_with_the_other_files_a_block_at_a_time(tmp_path, monkeypatch):
    """An item written from its memory goes in runs of ``block_size``, interleaved with the other files' runs: a
    large one does not hold every write in flight to its own file while the others wait."""
    writes: list[tuple[str, int]] = []
    real = Engine.write

    def spy(self, file, data, offset):
        writes.append((file.path, data.nbytes))
        return real(self, file, data, offset)

    monkeypatch.setattr(Engine, "write", spy)
    state = {"a": torch.randn(1 << 18), "b": torch.randn(1 << 18)}  # 1 MiB each: one a file
    # the page cache, where each file's writes run one at a time; one host thread: the ring writes them
    config = IOConfig(direct_io=False, block_size=128 << 10, direct_min=64 << 10, host_threads=1)
    writer = save(state, tmp_path / "ck", lanes_per_dir=2, config=config)
    assert len(writer.last_save.files) == 2
    assert [n for _, n in writes] == [128 << 10] * 16
    order = [path for path, _ in writes]
    assert order[0] != order[1] and order == order[:2] * 8  # the two files in turn
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load(target, tmp_path / "ck")
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_auto_lanes_write_one_file_a_directory_with_o_direct(tmp_path):
    writer = save(state_of(4), tmp_path / "ckpt", data_dirs=[tmp_path / "a", tmp_path / "b"])
    if writer.last_save.direct_io:  # a filesystem that takes O_DIRECT (the page cache case is above)
        assert len(writer.last_save.files) == 2
    explicit = save(state_of(4), tmp_path / "two", config=IOConfig(direct_io=False, host_threads=4), lanes_per_dir=1)
    assert len(explicit.last_save.files) == 1  # a number given is kept


@pytest.mark.skipif(filesystem_of("/dev/shm") != "tmpfs", reason="no tmpfs at /dev/shm here")
def test_the_kernel_is_found_to_copy_into_tmpfs_with_or_without_o_direct(tmp_path):
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        assert kernel_copies(shm, None) and kernel_copies(shm, True)
        assert auto_lanes([shm], IOConfig(host_threads=3), 1 << 40) == 6
        assert auto_lanes([shm, str(tmp_path)], IOConfig(host_threads=3), 1 << 40) == 3  # 6 files over both
        assert auto_lanes([shm], IOConfig(host_threads=3), 2 * LANE_BYTES) == 2  # a file for every LANE_BYTES
        assert auto_lanes([shm], IOConfig(host_threads=3), LANE_BYTES - 1) == 1
    if not kernel_copies(str(tmp_path), None):  # a disk that takes O_DIRECT: one file keeps it busy
        assert auto_lanes([str(tmp_path)], IOConfig(host_threads=3), 1 << 40) == 1


def test_a_small_state_is_one_file_whatever_the_filesystem(tmp_path):
    writer = save(state_of(5), tmp_path / "ckpt", config=IOConfig(direct_io=False, host_threads=4))
    assert len(writer.last_save.files) == 1


@pytest.mark.parametrize("lanes", [0, -2])
def test_a_lane_count_below_one_is_refused_not_taken_for_auto(tmp_path, lanes):
    with pytest.raises(ValueError, match="lanes_per_dir must be at least 1"):
        FastPersistWriter(tmp_path / "ckpt", lanes_per_dir=lanes)


def test_planned_bytes_count_the_tensors_of_a_plan():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner({"w": torch.zeros(10, 3, dtype=torch.bfloat16), "step": 3, "blob": {"a": [1, 2]}})
    assert planned_bytes(planner.create_local_plan().items) == 60


def test_a_writer_whose_saves_grow_to_more_files_gets_a_larger_pool(tmp_path, monkeypatch):
    config = IOConfig(direct_io=False, host_threads=2, num_buffers=2)
    with FastPersistWriter(tmp_path / "ckpt", config=config) as writer:
        dcp.save(state_of(6), storage_writer=writer)  # small: one file, the configured two buffers
        assert len(writer.last_save.files) == 1 and writer._resources.io.context().pool.count == 2
        monkeypatch.setattr(placement, "LANE_BYTES", 1024)
        dcp.save(state_of(7), storage_writer=writer)  # four files now: two buffers each
        assert len(writer.last_save.files) == 4 and writer._resources.io.context().pool.count == 8
    assert_loads(tmp_path / "ckpt", 7)
