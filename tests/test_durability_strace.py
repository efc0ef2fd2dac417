"""The order in which a save's steps reach the disk, read from the syscalls themselves (strace).

What a kill cannot show, a power cut could: data that was written but never
fsynced, a rename whose directory was never fsynced. So the order of the
durable steps is checked on the system calls of a real save, overwriting an
earlier checkpoint, in a child process under ``strace -f``:

1. every new data file is written, then fsynced, before ``.metadata`` is renamed into place;
2. every directory holding new data files is fsynced after those files and before the rename;
3. ``.metadata`` is written under a temporary name and fsynced before that name is renamed over it;
4. the checkpoint directory is fsynced after the rename;
5. the replaced checkpoint's files are unlinked only after that directory fsync.

The threads engine makes every data write and fsync a syscall of its own. With
io_uring they travel through the ring, invisible to strace; for it, claims 3-5
(plain syscalls in both engines) are checked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
from conftest import save

from fp_dcp import IOConfig
from fp_dcp._native import _cio
from fp_dcp.checkpoint import open_checkpoint

pytestmark = [
    pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed (make test installs it)"),
    pytest.mark.slow,
]

SYSCALLS = "openat,fsync,fdatasync,pwrite64,pwritev,pwritev2,write,renameat,renameat2,?rename,unlinkat,?unlink"

CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from fp_dcp import FastPersistWriter, IOConfig
    args = json.loads(sys.argv[1])
    state = {"w": torch.randn(300, 500), "b": torch.arange(1000), "few": {str(i): torch.ones(i + 1) for i in range(8)}}
    writer = FastPersistWriter(args["path"], data_dirs=args["data_dirs"], lanes_per_dir=args["lanes"],
                               config=IOConfig(engine=args["engine"]))
    dcp.save(state, storage_writer=writer)
    """
)


@dataclass
class Call:
    name: str
    args: str
    start: int  # line of the trace where the call began
    end: int  # line where it returned
    result: str

    def fd_path(self) -> str | None:
        """Path of the first file-descriptor argument (strace -y prints ``5</path>``)."""
        m = re.match(r"\s*\d+<(.*?)>", self.args)
        return m.group(1) if m else None

    def strings(self) -> list[str]:
        return re.findall(r'"((?:[^"\\]|\\.)*)"', self.args)


_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>(.*)|(\w+)\((.*))$")
_RESULT = re.compile(r"^(.*)\)\s+=\s+(.*)$")


def parse(trace: str) -> list[Call]:
    """Calls of every thread, each with the trace lines where it started and returned."""
    calls = []
    pending: dict[str, Call] = {}
    for number, line in enumerate(trace.splitlines()):
        m = _LINE.match(line)
        if not m:
            continue  # signals, exits
        pid, resumed_name, resumed_rest, name, rest = m.groups()
        if resumed_name:
            call = pending.pop(pid)
            done = _RESULT.match(resumed_rest)
            call.end, call.result = number, done.group(2) if done else "?"
            call.args += done.group(1) if done else resumed_rest
            calls.append(call)
        elif rest.endswith("<unfinished ...>"):
            pending[pid] = Call(name, rest[: -len("<unfinished ...>")], number, -1, "")
        else:
            done = _RESULT.match(rest)
            if done:
                calls.append(Call(name, done.group(1), number, number, done.group(2)))
    return sorted(calls, key=lambda c: c.start)


def strace_save(tmp_path, path: str, engine: str, data_dirs: list[str] | None, lanes: int) -> list[Call]:
    out = tmp_path / "save.trace"
    args = json.dumps({"path": path, "data_dirs": data_dirs, "lanes": lanes, "engine": engine})
    # -f: every thread; -y: paths of descriptors; -s: whole path strings; --seccomp-bpf: stop only on traced calls
    command = "strace -f --seccomp-bpf -qq -y -s 4096 -e signal=none".split()
    command += ["-e", f"trace={SYSCALLS}", "-o", str(out), sys.executable, "-c", CHILD, args]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0 and "ptrace" in run.stderr.lower():
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr
    return parse(out.read_text())


@pytest.mark.parametrize(
    "engine, layout",
    [("threads", "lanes"), ("threads", "data_dirs"), ("io_uring", "lanes")],
    ids=["threads-2-files", "threads-data_dirs", "io_uring-2-files"],
)
def test_durable_steps_in_syscall_order(tmp_path, engine, layout):
    if engine == "io_uring" and not _cio.HAVE_IO_URING:
        pytest.skip("built without liburing")
    ckpt = str(tmp_path / "ckpt")
    data_dirs = [str(tmp_path / "ssd0"), str(tmp_path / "ssd1")] if layout == "data_dirs" else None
    lanes = 2 if layout == "lanes" else 1
    old_state = {"a": torch.ones(1000), "b": torch.ones(500)}
    save(old_state, ckpt, data_dirs=data_dirs, lanes_per_dir=lanes, config=IOConfig(engine=engine))
    old = files_of(ckpt, data_dirs)
    assert len(old) == 2

    calls = strace_save(tmp_path, ckpt, engine, data_dirs, lanes)
    new = files_of(ckpt, data_dirs)
    assert len(new) == 2 and not new & old
    created = [c for c in calls if c.name == "openat" and "O_CREAT" in c.args and c.strings()[0].endswith(".distcp")]
    assert {c.strings()[0] for c in created} == new and all("O_EXCL" in c.args for c in created)  # never clobbers

    metadata = os.path.join(ckpt, ".metadata")
    (rename,) = [c for c in calls if c.name.startswith("rename") and c.strings()[-1] == metadata]
    assert rename.result == "0"
    tmp = rename.strings()[0]
    assert re.fullmatch(re.escape(ckpt) + r"/\.metadata\.[0-9a-f]+\.tmp", tmp)

    def fsyncs(path: str) -> list[Call]:
        return [c for c in calls if c.name in ("fsync", "fdatasync") and c.fd_path() == path and c.result == "0"]

    # 1 and 2: data written, fsynced, its directory fsynced, all before the rename
    if engine == "threads":
        for f in new:
            writes = [c for c in calls if c.name.startswith("pwrite") and c.fd_path() == f]
            synced = [c for c in fsyncs(f) if c.end < rename.start]
            assert writes and synced, f"{f} is not fsynced before .metadata is renamed"
            assert max(w.end for w in writes) < synced[0].start, f"{f} is written after its fsync began"
            directory = os.path.dirname(f)
            assert any(synced[0].end < c.start and c.end < rename.start for c in fsyncs(directory)), (
                f"{directory} is not fsynced between {os.path.basename(f)}'s fsync and the rename"
            )
    else:
        for directory in {os.path.dirname(f) for f in new}:
            assert any(c.end < rename.start for c in fsyncs(directory)), f"{directory} is not fsynced before the rename"

    # 3: the temporary .metadata written and fsynced before it is renamed; .metadata itself never written
    assert any(c.name == "write" and c.fd_path() == tmp and c.end < rename.start for c in calls)
    assert any(c.end < rename.start for c in fsyncs(tmp))
    assert not [c for c in calls if c.name == "openat" and c.strings()[0] == metadata and "O_WR" in c.args]

    # 4: the checkpoint directory fsynced after the rename
    after = [c for c in fsyncs(ckpt) if c.start > rename.end]
    assert after, "the directory is not fsynced after .metadata is renamed into place"

    # 5: the replaced files unlinked, each only after that fsync made the new .metadata durable
    unlinks = {c.strings()[-1]: c for c in calls if c.name.startswith("unlink")}
    assert old <= set(unlinks), f"replaced files not removed: {old - set(unlinks)}"
    for f in old:
        assert unlinks[f].start > after[0].end, f"{f} is removed before the new .metadata is durable"
    assert not new & set(unlinks)


def files_of(path: str, data_dirs: list[str] | None) -> set[str]:
    """Full paths of the data files the published checkpoint at ``path`` lists."""
    return set(open_checkpoint(path, data_dirs).files.values())
