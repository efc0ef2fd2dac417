"""Misuse and odd input: concurrent processes, a reused writer, odd directories, paths, keys and tensors."""

from __future__ import annotations

import collections
import errno
import multiprocessing
import os
import pickle
import resource
import subprocess
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import empty_like, failure, load, same_bytes, save, tmpfs
from torch.distributed.checkpoint.api import CheckpointException

from fp_dcp import (
    CorruptCheckpointError,
    FastPersistReader,
    FastPersistWriter,
    IOConfig,
    NotACheckpointError,
    UnsupportedTensorError,
    verify_checkpoint,
)
from fp_dcp.load import reader as reader_module
from fp_dcp.save import writer
from fp_dcp.testing import processes
from fp_dcp.testing.states import digests, empty_state, make_state

CTX: Any = processes.context()  # children forked from a server that has imported torch once
SIZE = 4 << 20


def run(target: Any, *args: Any) -> tuple[multiprocessing.process.BaseProcess, Connection]:
    receiver, sender = CTX.Pipe(duplex=False)
    child = CTX.Process(target=target, args=(sender, *args), daemon=True)
    child.start()
    sender.close()
    return child, receiver


def answer(receiver: Connection, timeout: float = 60) -> Any:
    assert receiver.poll(timeout), "the child did not answer in time"
    return receiver.recv()


def outcome(e: BaseException) -> tuple[str, str]:
    err = failure(pytest.ExceptionInfo.from_exception(e))
    return type(err).__name__, str(err)


def _save(conn: Connection, path: str, version: int, barrier: Any = None, pause: Any = None) -> None:
    """Save ``version``; wait at ``barrier`` first; with ``pause``, stop inside the save until it is set."""
    warnings.filterwarnings("ignore")
    state = make_state(SIZE, version)
    if pause is not None:
        real = writer.write_files

        def paused(*args: Any, **kwargs: Any) -> Any:
            conn.send("inside")  # the lock is held and data files are being made
            pause.wait(60)
            return real(*args, **kwargs)

        writer.write_files = paused
    if barrier is not None:
        barrier.wait(60)
    try:
        with FastPersistWriter(path) as w:
            dcp.save(state, storage_writer=w)
        conn.send(("ok", ""))
    except BaseException as e:
        conn.send(outcome(e))


def _saves(conn: Connection, path: str, versions: list[int]) -> None:
    warnings.filterwarnings("ignore")
    states = {v: make_state(SIZE, v) for v in versions}
    with FastPersistWriter(path) as w:
        for v in versions:
            dcp.save(states[v], storage_writer=w)
    conn.send("done")


def _loads(conn: Connection, path: str, stop: Any) -> None:
    """Load again and again until ``stop``; each load is checked bit-exact against the version it claims."""
    warnings.filterwarnings("ignore")
    results = []
    while not stop.is_set() or not results:
        target = empty_state(SIZE)
        try:
            dcp.load(target, storage_reader=FastPersistReader(path))
        except BaseException as e:
            results.append(outcome(e))
            continue
        version = target["meta"]["version"]
        exact = digests(target) == digests(make_state(SIZE, version))
        results.append(("ok" if exact else "wrong", str(version)))
    conn.send(results)


def assert_holds(path: Path, version: int) -> None:
    """The directory holds exactly ``version``'s checkpoint, bit-exact, and nothing of any other save."""
    target = empty_state(SIZE)
    load(target, path)
    assert digests(target) == digests(make_state(SIZE, version))
    published = {file for file, *_ in FastPersistReader(path).read_metadata().storage_data.values()}
    assert set(os.listdir(path)) == published | {".metadata", ".lock"}


def test_second_process_saving_into_a_directory_being_saved_gets_a_clear_error(ckpt):
    pause = CTX.Event()
    first, first_answer = run(_save, str(ckpt), 1, None, pause)
    assert answer(first_answer) == "inside"
    second, second_answer = run(_save, str(ckpt), 2)
    kind, message = answer(second_answer)
    assert kind == "CheckpointBusyError" and "another save to" in message and "is in progress" in message
    pause.set()
    assert answer(first_answer) == ("ok", "")
    first.join(), second.join()
    assert_holds(ckpt, 1)


def test_two_processes_racing_to_save_never_interleave(ckpt):
    for round_ in range(3):
        barrier = CTX.Barrier(2)
        versions = (2 * round_ + 1, 2 * round_ + 2)
        children = [run(_save, str(ckpt), v, barrier) for v in versions]
        answers = [answer(receiver) for _, receiver in children]
        for child, _ in children:
            child.join()
        assert ("ok", "") in answers, answers
        for kind, message in answers:
            assert kind == "ok" or (kind == "CheckpointBusyError" and "is in progress" in message), answers
        winners = [v for v, a in zip(versions, answers, strict=True) if a[0] == "ok"]
        target = empty_state(SIZE)
        load(target, ckpt)
        assert target["meta"]["version"] in winners
        assert_holds(ckpt, target["meta"]["version"])


def test_saving_while_another_process_loads(ckpt):
    """Loads during overwrites get a checkpoint bit-exact, or a CheckpointError saying what went away."""
    save(make_state(SIZE, 100), ckpt).close()
    stop = CTX.Event()
    loader, loads = run(_loads, str(ckpt), stop)
    saver, saves = run(_saves, str(ckpt), list(range(101, 109)))
    assert answer(saves, 120) == "done"
    stop.set()
    results = answer(loads, 120)
    loader.join(), saver.join()
    print(collections.Counter(kind for kind, _ in results))  # shown with -s: how the races went
    kinds = {kind for kind, _ in results}
    assert "wrong" not in kinds, results
    assert "ok" in kinds
    for kind, message in results:  # a load racing the removal of the files it was about to read
        assert kind == "ok" or (kind == "CheckpointReplacedError" and "load again" in message), (kind, message)
    assert_holds(ckpt, 108)


def test_load_racing_an_overwrite_is_not_called_corrupt(ckpt, monkeypatch):
    """.metadata read, then the checkpoint replaced before its data files are opened: the files it names are gone."""
    old, new = make_state(SIZE, 1), make_state(SIZE, 2)
    save(old, ckpt).close()
    real = reader_module.read_items

    def overwrite_then_read(*args: Any, **kwargs: Any) -> Any:
        save(new, ckpt).close()
        return real(*args, **kwargs)

    monkeypatch.setattr(reader_module, "read_items", overwrite_then_read)
    target = empty_state(SIZE)
    try:
        load(target, ckpt)
    except CheckpointException as e:
        err = failure(pytest.ExceptionInfo.from_exception(e))
        assert not isinstance(err, CorruptCheckpointError) and "replaced" in str(err), err
    else:  # or readers keep the files they are reading alive
        assert digests(target) == digests(old)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_one_writer_many_saves_memory_and_files_stay_flat(tmp_path):
    few = {str(i): torch.ones(i + 1) for i in range(20)}
    state = {"w": torch.randn(8 << 20), "b": torch.arange(10_000), "few": few}
    before = set(os.listdir("/proc/self/fd"))
    sizes = []
    with FastPersistWriter(tmp_path / "step-0", config=IOConfig(buffer_size=1 << 20, block_size=1 << 20)) as w:
        for i in range(20):
            dcp.save(state, storage_writer=w, checkpoint_id=tmp_path / f"step-{i % 2}")  # two directories in turn
            sizes.append(rss())
    assert len(set(os.listdir("/proc/self/fd")) ^ before) <= 1  # at most the descriptor of the listing itself
    growth = max(sizes[5:]) - sizes[4]
    print(f"RSS after saves 5..20: {[round(s / 2**20) for s in sizes[4:]]} MiB")  # shown with -s
    assert growth < 8 << 20, [s >> 20 for s in sizes]  # a leak of one 32 MiB state per save would show at once
    for d in ("step-0", "step-1"):
        assert len([n for n in os.listdir(tmp_path / d) if n.endswith(".distcp")]) == 1
        target = empty_like(state)
        load(target, tmp_path / d)
        assert same_bytes(target["w"], state["w"])


# ---------------------------------------------------------------- what a reader is given


def test_reader_given_directories_that_are_not_fp_dcp_checkpoints(tmp_path):
    cases = {
        "garbage": lambda d: (d / ".metadata").write_bytes(os.urandom(300)),
        "empty": lambda d: (d / ".metadata").write_bytes(b""),
        "other_pickle": lambda d: (d / ".metadata").write_bytes(pickle.dumps({"not": "metadata"})),
        "metadata_is_a_directory": lambda d: (d / ".metadata").mkdir(),
        "data_without_metadata": lambda d: (d / "__0_0.distcp").write_bytes(b"\0" * 4096),
    }
    errors = {}
    for name, make in cases.items():
        d = tmp_path / name
        d.mkdir()
        make(d)
        with pytest.raises((CorruptCheckpointError, NotACheckpointError)) as e:
            FastPersistReader(d).read_metadata()
        errors[name] = e.value
        assert str(d) in str(e.value)
    assert "not fp-dcp metadata" in str(errors["garbage"]) and "not fp-dcp metadata" in str(errors["empty"])
    assert "not fp-dcp metadata" in str(errors["other_pickle"])
    assert isinstance(errors["metadata_is_a_directory"], NotACheckpointError)
    assert isinstance(errors["data_without_metadata"], NotACheckpointError)


# ---------------------------------------------------------------- odd tensors


def test_model_on_the_meta_device_is_refused_by_name(ckpt):
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    with pytest.raises(CheckpointException) as e:
        save({"model": model.state_dict()}, ckpt)
    err = failure(e)
    assert isinstance(err, UnsupportedTensorError) and "'model.weight'" in str(err) and "meta tensor" in str(err)
    assert not (ckpt / ".metadata").exists() and not list(ckpt.glob("*.distcp"))


def test_parameters_with_requires_grad_roundtrip_without_touching_autograd(ckpt):
    model = torch.nn.Linear(30, 20)
    model.weight.grad = torch.ones_like(model.weight)
    save({"model": model.state_dict(keep_vars=True)}, ckpt)
    fresh = torch.nn.Linear(30, 20)
    load({"model": fresh.state_dict(keep_vars=True)}, ckpt)
    for name, param in fresh.named_parameters():
        assert same_bytes(param.detach(), getattr(model, name).detach())
        assert param.requires_grad and param.is_leaf and param.grad is None and param.grad_fn is None


def test_tensors_sharing_storage_roundtrip_and_stay_tied(ckpt):
    base = torch.arange(200.0)
    state = {"base": base, "view": base[10:30], "transposed": base.view(10, 20).t(), "alias": base}
    save(state, ckpt)
    apart = empty_like(state)
    load(apart, ckpt)
    assert all(same_bytes(apart[k], state[k].contiguous()) for k in state)
    tied = torch.zeros(200)
    targets = {"base": tied, "view": tied[10:30], "transposed": tied.view(10, 20).t(), "alias": tied}
    load(targets, ckpt)
    assert same_bytes(tied, base) and targets["view"].data_ptr() == tied.data_ptr() + 10 * 4


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), RuntimeError, "NestedTensorImpl"),
        (
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
            AttributeError,
            "IntNode' object has no attribute 'add'",  # NestedIntNode; ConstantIntNode on torch 2.7
        ),
        (lambda: torch.ones(4, 4).to_mkldnn(), NotImplementedError, "OpaqueTensorImpl"),
    ],
    ids=["nested", "nested_jagged", "mkldnn"],
)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_tensor_kinds_torch_refuses_before_fp_dcp_sees_them(request, ckpt, make, error, words):
    """DCP's planner fails on these first (docs/reliability.md lists its messages); nothing is written."""
    if request.node.callspec.id == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no mkldnn")
    with pytest.raises(CheckpointException) as e:
        save({"fine": torch.ones(2), "odd": make()}, ckpt)
    err = failure(e)
    assert isinstance(err, error) and words in str(err)
    assert not (ckpt / ".metadata").exists() and not list(ckpt.glob("*.distcp"))


# ---------------------------------------------------------------- odd paths and keys


def test_keys_with_slashes_and_dots(ckpt):
    state = {"a/b": torch.ones(2), "a.b": torch.zeros(3), "c": {"d/e.f": torch.arange(4)}, "x/../y": torch.ones(1)}
    save(state, ckpt)
    target = empty_like(state)
    load(target, ckpt)
    assert all(same_bytes(target[k], state[k]) for k in ("a/b", "a.b", "x/../y"))
    assert same_bytes(target["c"]["d/e.f"], state["c"]["d/e.f"])
    assert sorted(os.listdir(ckpt))[:2] == [".lock", ".metadata"]  # the keys never become file names
    with pytest.raises(CheckpointException) as e:  # DCP flattens nested keys with ".": these two collide
        save({"x": {"y": torch.ones(2)}, "x.y": torch.zeros(2)}, ckpt)
    assert isinstance(failure(e), ValueError) and "duplicated flatten key x.y" in str(failure(e))
    assert verify_checkpoint(ckpt).ok  # and the failed save did not touch the checkpoint


def test_non_ascii_path(tmp_path):
    path = tmp_path / "チェックポイント" / "étape 100 ✓"
    state = {"ключ": torch.randn(100), "权重": torch.arange(7)}
    save(state, path)
    target = empty_like(state)
    load(target, path)
    assert all(same_bytes(target[k], state[k]) for k in state)
    assert verify_checkpoint(path).ok


def long_path(base: Path, length: int) -> Path:
    """A directory path of exactly ``length`` characters under ``base``, in components of at most 200."""
    path = base
    while len(str(path)) < length - 201:
        path = path / ("d" * 200)
    return path / ("x" * (length - len(str(path)) - 1))


def test_very_long_paths(tmp_path):
    state = {"w": torch.randn(1000)}
    near_limit = long_path(tmp_path, 4000)  # every file name inside still fits in PATH_MAX (4096)
    save(state, near_limit)
    target = empty_like(state)
    load(target, near_limit)
    assert same_bytes(target["w"], state["w"]) and verify_checkpoint(near_limit).ok

    with pytest.raises(CheckpointException) as e:  # one component longer than NAME_MAX (255)
        save(state, tmp_path / ("y" * 256))
    err = failure(e)
    assert isinstance(err, OSError) and err.errno == errno.ENAMETOOLONG and "y" * 256 in str(err)

    too_long_for_files = long_path(tmp_path, 4080)  # the directory fits, its data file names do not
    with pytest.raises(CheckpointException) as e:
        save(state, too_long_for_files)
    err = failure(e)
    assert isinstance(err, OSError) and err.errno == errno.ENAMETOOLONG and str(too_long_for_files) in str(err)
    assert set(os.listdir(too_long_for_files)) == {".lock"}


@pytest.fixture
def read_only_fs(tmp_path):
    """A tmpfs for a checkpoint that the test then remounts read-only."""
    with tmpfs(tmp_path / "ro", "16m") as mnt:
        yield mnt


def test_read_only_filesystem(read_only_fs):
    state = {"w": torch.randn(1000)}
    save(state, read_only_fs / "ckpt").close()
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_fs)], check=True)
    for path in (read_only_fs / "ckpt", read_only_fs / "new"):
        w = FastPersistWriter(path)
        with pytest.raises(CheckpointException) as e:
            dcp.save(state, storage_writer=w)
        w.close()
        err = failure(e)
        assert isinstance(err, OSError) and err.errno == errno.EROFS and str(path) in str(err)
    target = empty_like(state)
    load(target, read_only_fs / "ckpt")  # loading needs no write access
    assert same_bytes(target["w"], state["w"]) and verify_checkpoint(read_only_fs / "ckpt").ok
