"""The ``fp-dcp`` command (also ``python -m fp_dcp``).

    fp-dcp inspect PATH [--json]             what a checkpoint holds
    fp-dcp verify PATH                       check every checksum and the metadata
    fp-dcp ls ROOT [--verify]                the steps of a run (CheckpointManager's root)
    fp-dcp convert SRC DST --to FORMAT       fp-dcp / stock DCP / torch.save / safetensors
    fp-dcp bench [--plot out.png]            the benchmark (fp-dcp bench)
    fp-dcp tune DIR                          the best save and load settings for a directory, in a minute

Exit status: 0 on success (for ``verify``: everything intact), 1 when the
checkpoint is damaged or the command failed (the message says why), 2 for
bad command-line arguments. Progress goes to stderr as a bar when stderr is
a terminal or ``--progress`` is given; ``-v`` also shows fp-dcp's log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import TextIO

from torch.distributed.checkpoint.api import CheckpointException

from .. import (
    SafetensorsVerifyReport,
    VerifyReport,
    __version__,
    clean_unfinished,
    list_steps,
    remove_leftovers,
    unfinished,
    verify_checkpoint,
)
from ..io.progress import progress_text
from ..units import MiB
from . import bench
from .convert import FORMATS, MAX_SHARD_SIZE, convert
from .inspect import human, inspect_checkpoint, plural, print_inspect
from .tune import AxisResult, DiskLimit, tune
from .workload import fresh_allocations

__all__ = ["ProgressBar", "build_parser", "main"]


class ProgressBar:
    """``label [#####-------] 1.20/4.00 GB, 1.50 GB/s, ETA 2 s`` on ``stream``; a ``progress(done, total)`` callback.

    On a terminal the line is redrawn in place ten times a second; elsewhere
    (``--progress`` into a log file) a new line is written every few seconds.
    """

    def __init__(self, label: str, stream: TextIO | None = None, *, width: int = 24) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self.interval = 0.1 if self.tty else 5.0
        self.start: float | None = None
        self.last = 0.0
        self.state = (-1, -1)

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = self.last = now
        changed = (done, total) != self.state
        self.state = (done, total)
        if changed and (now - self.last >= self.interval or done >= total):
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        done, total = self.state
        filled = self.width * done // total if total else self.width
        text = progress_text(done, total, now - (self.start or now))
        line = f"{self.label} [{'#' * filled}{'-' * (self.width - filled)}] {text}"
        self.stream.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line (nothing if it never drew)."""
        if self.start is not None and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _progress_bar(args: argparse.Namespace, label: str) -> ProgressBar | None:
    return ProgressBar(label) if args.progress or sys.stderr.isatty() else None


def _cmd_inspect(args: argparse.Namespace) -> int:
    info = inspect_checkpoint(args.path, args.data_dirs or None)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print_inspect(info)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    bar = _progress_bar(args, "verify")
    start = time.perf_counter()
    try:
        report = verify_checkpoint(args.path, args.data_dirs or None, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    intact = report.ok and not report.problems
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2, default=str))
    else:
        for problem in report.problems:
            print(f"BAD  {problem}")
        verdict = "intact" if intact else f"DAMAGED ({plural(len(report.problems), 'problem')})"
        if isinstance(report, VerifyReport) and report.partial:  # a node's copy of a tiered step: not damage
            verdict = report.partial if intact else f"{verdict}, {report.partial}"
        print(f"{args.path}: {verdict}: {_checked(report)}, in {seconds:.1f} s")
    return 0 if intact else 1


def _checked(report: VerifyReport) -> str:
    """What ``verify`` checked, for its last line."""
    if isinstance(report, SafetensorsVerifyReport):
        read = f"{plural(report.items, 'tensor')} in {plural(report.files, 'file')}, {human(report.read_bytes)} read"
        if not report.hashed_files:
            return f"{read}; structure checked, no checksums stored (none recorded by a Hugging Face download)"
        return f"{read}; structure checked, {report.hashed_files} of {report.files} against Hugging Face's SHA-256"
    checked = f"{human(report.bytes)} checked" if report.checksums else "no checksums stored (files and sizes checked)"
    return f"{plural(report.items, 'item')}, {checked}"


def _cmd_ls(args: argparse.Namespace) -> int:
    steps = list_steps(args.root, verify=args.verify)
    if args.clean:
        for s in steps:
            if s.leftovers:
                removed = remove_leftovers(s.path)
                print(f"{s.path}: removed {plural(len(removed), 'leftover file')}", file=sys.stderr)
        if unfinished(args.root):
            print(f"{args.root}: removed {', '.join(clean_unfinished(args.root))}", file=sys.stderr)
        steps = list_steps(args.root, verify=args.verify)
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in steps], indent=2))
    else:
        header = f"{'step':>10}  {'status':<10}  {'size':>10}  {'written':>10}  {'published (UTC)':<19}  references"
        print(f"{header:<89}  {'copies':<20}  problem")
        for s in steps:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s.published)) if s.published else "-"
            line = f"{s.step:>10}  {s.status:<10}  {human(s.bytes):>10}  {human(s.written):>10}  {when:<19}"
            copies = ",".join(s.copies) or "-"
            print(f"{line}  {' '.join(s.references) or '-':<20}  {copies:<20}  {s.problem}".rstrip())
            if s.leftovers:
                names = ", ".join(s.leftovers[:3]) + (", ..." if len(s.leftovers) > 3 else "")
                print(f"{'':>10}  + {plural(len(s.leftovers), 'leftover file')} no checkpoint lists: {names}")
        print(f"{args.root}: {plural(len(steps), 'step')}")
        if any(s.leftovers for s in steps):
            print("leftovers: a save that died, or the replaced files of an overwrite cut short; --clean removes them")
        others = unfinished(args.root)
        if others:
            print(
                f"not checkpoints: {', '.join(others)} (.spare: a pruned step whose files the next save "
                "overwrites; .deleting-*: a removal cut short); the manager removes them when it opens the root, "
                "--clean now"
            )
    return 0 if all(s.status != "corrupt" for s in steps) else 1


def _cmd_convert(args: argparse.Namespace) -> int:
    bar = _progress_bar(args, "read")
    try:
        summary = convert(
            args.src,
            args.dst,
            to=args.to,
            data_dirs=args.data_dirs or None,
            overwrite=args.force,
            drop_non_tensors=args.drop_non_tensors,
            max_shard_size=args.max_shard_size,
            progress=bar,
        )
    finally:
        if bar is not None:
            bar.close()
    print(
        f"converted {args.src} ({summary.source_format}) to {args.dst} ({summary.target_format}): "
        f"{plural(summary.tensors, 'tensor')}, {human(summary.bytes)} in {summary.seconds:.1f} s"
    )
    return 0  # entries dropped for safetensors were named by the convert module's warning


def _format_value(axis: str, value: int | bool | None) -> str:
    if value is None:
        return "auto"
    if axis in ("direct_writes", "direct_reads"):
        return "in-place" if value else "copy"
    assert isinstance(value, int)  # every other axis is a count or a size
    return f"{value >> 20}M" if axis.endswith("_size") else str(value)


def _print_axis(result: AxisResult) -> None:
    cells = []
    for value in result.runs:
        mark = "*" if value == result.chosen else " "
        cells.append(f"{_format_value(result.axis, value)}:{result.median(value):5.2f}{mark}")
    rounds = len(next(iter(result.runs.values())))
    print(f"  {result.side} {result.axis:<14} {'  '.join(cells)}  GB/s, median of {rounds}", flush=True)


def _fio_line(fio: DiskLimit) -> str:
    runs = [f"{rw} {gbps:.2f} GB/s" for rw, gbps in (("write", fio.write_gbps), ("read", fio.read_gbps)) if gbps]
    return f"  fio (the disk's limit): {', '.join(runs) + ', ' if runs else ''}{fio.note}"


def _cmd_tune(args: argparse.Namespace) -> int:
    size = int(args.size_mb * MiB)
    fresh_allocations()  # the loads' fresh targets mapped afresh every time, as in a new process
    print(
        f"fp-dcp tune: saving and loading a {human(size)} state dict in {args.dir} for up to {args.budget:.0f} s",
        flush=True,
    )
    print(
        "  (* = chosen: faster than the current value by more than "
        f"{args.min_gain:.0f} % in every round, else the current value stays;\n"
        "   loads are cold: the checkpoint is evicted from the page cache before each)",
        flush=True,
    )
    result = tune(
        args.dir,
        budget_s=args.budget,
        size_bytes=size,
        repeats=args.repeats,
        min_gain=args.min_gain / 100,
        on_axis=_print_axis,
    )
    print(_fio_line(result.fio))
    engine = result.engine
    print(
        f"engine: {engine['engine']}, O_DIRECT: {engine.get('direct_io')}, alignment {engine.get('alignment')}; "
        f"{result.seconds:.0f} s"
    )
    untried = [
        f"{side} {name}" for side, sweep in (("save", result.save), ("load", result.load)) for name in sweep.untried
    ]
    if untried:
        print(f"not tried (out of time): {', '.join(untried)}; raise --budget or lower --size-mb")
    for side, sweep in (("save", result.save), ("load", result.load)):
        lanes = f", lanes_per_dir={sweep.best.lanes_per_dir}" if sweep.best.lanes_per_dir is not None else ""
        same = "  (the defaults)" if sweep.best == sweep.baseline else ""
        print(f"best {side}: {sweep.config_line()}{lanes}{same}")
    print("IOConfig is shared by FastPersistWriter and FastPersistReader: give each its own to use both:")
    print(f"paste: writer = {result.writer_line()}")
    print(f"paste: reader = {result.reader_line()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fp-dcp`` (every subcommand has ``--help``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", help="show fp-dcp's log (INFO) and tracebacks on stderr"
    )
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument(
        "--progress", action="store_true", help="show a progress bar even when stderr is not a terminal"
    )
    data_dirs = argparse.ArgumentParser(add_help=False)
    data_dirs.add_argument(
        "--data-dir",
        dest="data_dirs",
        action="append",
        metavar="DIR",
        help="a data directory the checkpoint was saved with (repeat, in the same order as data_dirs=)",
    )

    parser = argparse.ArgumentParser(
        prog="fp-dcp",
        description="Inspect, verify, convert fp-dcp and torch DCP checkpoints; benchmark and tune the disk.",
        epilog="Exit status: 0 success, 1 damaged checkpoint or failure, 2 bad arguments. "
        "'fp-dcp COMMAND --help' describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"fp-dcp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "inspect",
        parents=[common, data_dirs],
        help="list a checkpoint's items, files and format",
        description="List the items of a checkpoint (fp-dcp, torch FileSystemWriter, or a directory of safetensors "
        "files): fqn, dtype, global shape, chunks, stored bytes and file; totals, format version and writer.",
    )
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_cmd_inspect)

    p = sub.add_parser(
        "verify",
        parents=[common, progress, data_dirs],
        help="check every checksum and the metadata",
        description="Check a checkpoint's metadata and every item's checksum (a directory of safetensors files: "
        "its structure, every byte, and the hashes a Hugging Face download recorded). Prints each damaged item "
        "and its file; exits 0 only when everything is intact, 1 otherwise.",
    )
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_cmd_verify)

    p = sub.add_parser(
        "ls",
        parents=[common],
        help="list the steps of a run (a CheckpointManager root)",
        description="List the step-N checkpoints under a run's root: step, status (complete, verified, incomplete, "
        "corrupt, retired), size, bytes its save wrote, when it was published, the steps whose files it references "
        "(incremental runs), and what is wrong with it. Exits 1 if a step is corrupt.",
    )
    p.add_argument("root", help="the run's root directory")
    p.add_argument("--verify", action="store_true", help="check every checksum of every step (reads all data)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--clean",
        action="store_true",
        help="remove the leftover data files of published steps, and what a pruning left in the root (.spare, "
        ".deleting-*); not while a save or a manager runs",
    )
    p.set_defaults(run=_cmd_ls)

    p = sub.add_parser(
        "convert",
        parents=[common, progress, data_dirs],
        help="convert between fp-dcp, DCP, torch.save, safetensors",
        description="Convert a checkpoint (fp-dcp or torch DCP directory, torch.save or safetensors file; recognised "
        "from its contents) to another format. The whole state dict is held in memory once. DCP metadata and "
        "torch.save files are pickles: convert only files you trust.",
    )
    p.add_argument("src", help="source checkpoint directory or file")
    p.add_argument(
        "dst", help="destination directory (fp, dcp, safetensors) or file (torch; safetensors named *.safetensors)"
    )
    p.add_argument("--to", required=True, choices=FORMATS, help="target format")
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    p.add_argument(
        "--drop-non-tensors",
        action="store_true",
        help="for safetensors (tensors only): leave out non-tensor entries instead of refusing",
    )
    p.add_argument(
        "--max-shard-size",
        default=MAX_SHARD_SIZE,
        metavar="SIZE",
        help=f"for a safetensors directory: the most bytes per file, as Hugging Face's max_shard_size "
        f"(default {MAX_SHARD_SIZE}; 500MB, 2GiB, or bytes); a larger tensor gets a file of its own",
    )
    p.set_defaults(run=_cmd_convert)

    # Options are bench.main's own: everything after 'bench' goes to it unparsed (see main).
    sub.add_parser(
        "bench",
        add_help=False,
        help="run the benchmark (fp-dcp bench --help for its options; --plot out.png)",
    )

    p = sub.add_parser(
        "tune",
        parents=[common],
        help="find the best save and load settings for a directory",
        description="Measure the disk's limit with fio (from huge-page buffers), then save a synthetic state dict "
        "into DIR again and again, sweeping direct_writes, queue_depth, block_size, lanes_per_dir and buffer_size "
        "one at a time, then load it cold again and again, sweeping direct_reads, queue_depth, block_size, "
        "buffer_size and num_buffers; print the best writer and reader settings to paste. Bounded by --budget.",
    )
    p.add_argument("dir", help="directory on the disk checkpoints will be written to (created if missing)")
    p.add_argument("--budget", type=float, default=60.0, help="seconds for the whole sweep (default 60)")
    p.add_argument("--size-mb", type=float, default=512, help="synthetic state dict size in MiB (default 512)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per setting (default 3)")
    p.add_argument(
        "--min-gain", type=float, default=5.0, help="speed-up in %% a value needs in every round (default 5)"
    )
    p.set_defaults(run=_cmd_tune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fp-dcp`` with ``argv`` (default: the command line); returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(args_list)
    if args.command == "bench":
        args.run, args.verbose = lambda _: bench.main(rest, prog="fp-dcp bench"), False
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # fp-dcp's warnings (and with -v its INFO log) go to stderr whatever the logging set-up of a host process;
    # its messages name their source ("fp-dcp load: ...").
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("fp_dcp")
    old_level = logger.level
    logger.addHandler(handler)
    if args.verbose:
        logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            # Single-process use is the point here; DCP would warn about it on every call.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            status: int = args.run(args)
            return status
    except KeyboardInterrupt:
        return 130
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        if args.verbose:
            traceback.print_exc()
        print(f"fp-dcp {args.command}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
