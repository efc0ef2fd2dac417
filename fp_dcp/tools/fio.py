"""fio as the disk's reference: sequential O_DIRECT transfers through io_uring, from buffers in huge pages.

A request from memory in 4 KiB pages gathers a segment per page, so on a
disk that takes larger requests than its ``max_segments`` pages hold (a
virtio disk: 254 segments, 4 MiB requests) fio's requests from its plain
buffers stay far below the largest and it reads and writes well below what
the disk can (``fp_dcp.io.device``; docs/benchmarks.md, its opening
paragraph). From buffers in huge pages (``--iomem=shmhuge``) its requests
reach the device's largest size. Those pages come only from the kernel's
pool, ``/proc/sys/vm/nr_hugepages``: ``reference`` raises it by what fio
needs (root only), checks that fio allocates its buffers there, and puts the
setting back afterwards, also when the work inside fails or is interrupted.
Where it cannot, fio runs with its plain buffers and ``Fio.buffers`` says
why. ``fp-dcp bench``, ``fp-dcp tune`` and the benchmarks in
``benchmarks/`` all run fio through here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator

from ..units import MiB

__all__ = ["BLOCK", "DEPTH", "Fio", "Jobs", "Transfer", "huge_pages", "installed", "reference"]

DEPTH = 32  # requests in flight
BLOCK = 8 * MiB  # bytes per request
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"
MEMINFO = "/proc/meminfo"
_SPARE_PAGES = 2  # fio adds a page of alignment to its buffers


def installed() -> bool:
    """Whether the ``fio`` command is on the PATH (Debian package ``fio``)."""
    return shutil.which("fio") is not None


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One fio run as fio measured it: the bytes moved and the seconds its I/O took."""

    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclasses.dataclass(frozen=True)
class Fio:
    """How fio runs here: ``depth`` requests of ``block`` bytes in flight, from huge pages or, where not, why not."""

    depth: int = DEPTH
    block: int = BLOCK
    huge_page: int | None = None  # the size of the huge pages its buffers are in; None: fio's plain buffers
    why_plain: str = ""

    @property
    def label(self) -> str:
        """A short name for a table's row: ``fio depth 32, huge pages`` (or ``4 KiB pages``)."""
        return f"fio depth {self.depth}, {'huge pages' if self.huge_page else '4 KiB pages'}"

    @property
    def buffers(self) -> str:
        """``huge-page buffers``, or ``plain buffers (why)``: for the fio line of a report."""
        return "huge-page buffers" if self.huge_page else f"plain buffers ({self.why_plain})"

    def args(self, path: str, rw: str, size: int, runtime_s: float | None = None) -> list[str]:
        """The command line of a ``rw`` (``write`` or ``read``) of ``size`` bytes of ``path``, stopped after
        ``runtime_s`` if given."""
        args = [
            "fio", "--name=limit", f"--filename={path}", f"--rw={rw}", f"--size={size}", f"--bs={self.block}",
            f"--iodepth={self.depth}", "--direct=1", "--ioengine=io_uring", "--output-format=json",
        ]  # fmt: skip
        if rw == "write":
            args.append("--end_fsync=1")
        if self.huge_page:
            args += ["--iomem=shmhuge", f"--hugepage-size={self.huge_page}"]
        if runtime_s is not None:
            args.append(f"--runtime={max(1, round(runtime_s * 1000))}ms")
        return args

    def run(self, path: str, rw: str, size: int, runtime_s: float | None = None) -> Transfer:
        """Run fio (see ``args``); a failure raises ``RuntimeError`` with fio's own message."""
        done = subprocess.run(self.args(path, rw, size, runtime_s), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"fio {rw} of {path} failed: {_fio_error(done.stderr, done.stdout)}")
        job = json.loads(done.stdout[done.stdout.find("{") :])["jobs"][0][rw]
        return Transfer(int(job["io_bytes"]), job["runtime"] / 1000)


@dataclasses.dataclass(frozen=True)
class Jobs(Fio):
    """fio as ``jobs`` processes at once (``--numjobs``). ``run(path, rw, size)`` takes the directories,
    ``:``-separated: job ``j`` writes ``fio.<j>`` in directory ``j`` modulo their count, ``size`` bytes each.
    ``direct=False``: buffered, where the filesystem refuses O_DIRECT. ``allocate_first=False``: no
    ``fallocate`` while fio lays its files out, off its clock: on tmpfs that allocates every page of the
    file, much of what a write into it costs (docs/benchmarks.md, "A node on one machine"), and fp-dcp's
    saves allocate theirs on theirs.
    ``cached=True``: reads find what the page cache holds (fio drops a file's cached pages before a job by
    default)."""

    jobs: int = 1
    direct: bool = True
    allocate_first: bool = True
    cached: bool = False

    def args(self, path: str, rw: str, size: int, runtime_s: float | None = None) -> list[str]:
        args = [a for a in super().args(path, rw, size, runtime_s) if not a.startswith("--filename=")]
        if not self.direct:
            args[args.index("--direct=1")] = "--direct=0"
        if not self.allocate_first:
            args.append("--fallocate=none")
        if self.cached:
            args.append("--invalidate=0")
        jobs = [f"--directory={path}", "--filename_format=fio.$jobnum", f"--numjobs={self.jobs}", "--group_reporting"]
        return args + jobs  # one report for all jobs: bytes summed, the longest job's runtime


def _fio_error(stderr: str, stdout: str) -> str:
    lines = [line for line in (stderr + stdout).splitlines() if line.startswith("fio:")]
    return lines[0].removeprefix("fio:").strip() if lines else (stderr.strip() or "no message")


def _meminfo(field: str) -> int:
    with open(MEMINFO) as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0])
    raise KeyError(f"{MEMINFO} has no {field}")


@contextlib.contextmanager
def huge_pages(nbytes: int) -> Iterator[tuple[int | None, str]]:
    """At least ``nbytes`` of free huge pages while the block runs: yields (their size, "") or (None, why not).

    Raises ``nr_hugepages`` by the pages missing (which needs root) and puts
    back the value it found afterwards, whatever ends the block: an
    exception, Ctrl-C, SIGTERM or SIGHUP (``_signals_unwind``).
    """
    try:
        page = _meminfo("Hugepagesize") * 1024
        free = _meminfo("HugePages_Free")
        with open(NR_HUGEPAGES) as f:
            before = int(f.read())
    except (OSError, KeyError, ValueError):
        page = 0
    if not page:
        yield None, "this kernel has no huge pages"
        return
    need = -(-nbytes // page) + _SPARE_PAGES
    if free >= need:
        yield page, ""
        return
    with _signals_unwind():
        refused = ""
        try:
            try:
                with open(NR_HUGEPAGES, "w") as f:
                    f.write(f"{before + need - free}\n")
            except OSError as e:
                who = "" if os.geteuid() == 0 else " (root only)"
                refused = f"cannot reserve huge pages in {NR_HUGEPAGES}{who}: {e.strerror}"
            if refused:
                yield None, refused
                return
            got = _meminfo("HugePages_Free")
            if got >= need:
                yield page, ""
            else:
                yield None, f"the kernel found {got} of the {need} huge pages asked for: memory too fragmented"
        finally:
            if not refused:
                with open(NR_HUGEPAGES, "w") as f:
                    f.write(f"{before}\n")


@contextlib.contextmanager
def _signals_unwind() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGHUP end the process as ``sys.exit(128 + signal)`` does, unwinding it.

    Their default action ends the process at once, skipping every
    ``finally`` (Ctrl-C's SIGINT raises KeyboardInterrupt and unwinds
    already): here they raise ``SystemExit`` in the main thread instead, so
    the huge pages are given back, the fio child is killed and a
    benchmark's files are removed on the way out, and the exit status is
    the shell's for a killed process (143 for SIGTERM). Only the main
    thread may set handlers: elsewhere, and for a signal that has a handler
    of its own or is ignored, nothing changes.
    """
    taken = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) == signal.SIG_DFL:
                taken[signum] = signal.signal(signum, _exit_unwinding)
    try:
        yield
    finally:
        for signum, previous in taken.items():
            signal.signal(signum, previous)


def _exit_unwinding(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def reference(depth: int = DEPTH, block: int = BLOCK) -> Iterator[Fio | None]:
    """fio set up to run from huge-page buffers while the block runs; None where fio is not installed.

    The huge pages stay reserved until the block ends; a probe (fio's null
    engine: no file, no I/O) checks that fio gets its buffers in them.
    """
    if not installed():
        yield None
        return
    with huge_pages(depth * block) as (page, why):
        if page is not None:
            why = _probe(depth, block, page)
        yield Fio(depth, block, page if not why else None, why)


def _probe(depth: int, block: int, page: int) -> str:
    """Why fio cannot allocate its buffers in huge pages of ``page`` bytes ("" if it can)."""
    done = subprocess.run(
        ["fio", "--name=probe", "--ioengine=null", f"--size={block}", f"--bs={block}", f"--iodepth={depth}",
         "--iomem=shmhuge", f"--hugepage-size={page}", "--output-format=terse"],
        capture_output=True, text=True,
    )  # fmt: skip
    return "" if done.returncode == 0 else f"fio could not use the huge pages: {_fio_error(done.stderr, done.stdout)}"
