"""Conversions between fp-dcp checkpoints, stock DCP checkpoints, torch.save files and safetensors.

    fp-dcp convert SRC DST --to {fp,dcp,torch,safetensors}
    fp_dcp.convert.convert(src, dst, to="torch")

Formats: ``fp`` (a ``FastPersistWriter`` checkpoint directory), ``dcp`` (a
torch ``FileSystemWriter`` checkpoint directory), ``torch`` (one
``torch.save`` file) and ``safetensors``: a directory laid out as Hugging
Face's ``save_pretrained`` lays it out, written by ``SafetensorsWriter``
(files ``model-0000i-of-0000N.safetensors`` of at most ``max_shard_size``
bytes each and ``model.safetensors.index.json``), or, for a destination
named ``*.safetensors``, one file (needs the ``safetensors`` package:
``pip install fp-dcp[safetensors]``). A source may also be a Hugging Face
directory of safetensors files (``fp_dcp.load.safetensors``), read by
``FastPersistReader`` without the package. The source's format is
recognised from its contents.

How: DCP's own machinery wherever it exists.

- torch.save file to stock DCP is ``torch.distributed.checkpoint.format_utils.torch_save_to_dcp``.
- A checkpoint directory (any kind) is materialised as DCP's
  ``format_utils.dcp_to_torch_save`` does it: ``_load_state_dict`` into an
  empty dict with ``_EmptyStateDictLoadPlanner``, which rebuilds the state
  dict, nesting and non-tensor values included, from the checkpoint's
  metadata. The reader is ``FastPersistReader`` (it reads stock checkpoints
  through torch's ``FileSystemReader``), and the planner counts the bytes
  read, for progress; ``dcp_to_torch_save`` itself offers neither.
- DCP destinations are written with ``torch.distributed.checkpoint.save``
  (``FastPersistWriter`` or ``FileSystemWriter``), and so are safetensors
  directories (``SafetensorsWriter``); file destinations are written under a
  temporary name, fsynced and renamed into place.
- Safetensors shards follow Hugging Face's rule (``huggingface_hub``'s
  ``split_torch_state_dict_into_shards``): tensors in the state dict's
  order, a new file where the next tensor would take the current one past
  ``max_shard_size``, a tensor larger than that in a file of its own. The
  directory is written beside the destination and renamed into place, so
  a new destination appears whole or not at all; over an existing one
  (``overwrite``), whose other files (``config.json``, a tokenizer) stay,
  the old checkpoint's files are removed and the new ones moved in, the
  index last.

Memory: the whole state dict is held in host memory once, every tensor at
full size on the CPU, whatever the direction (torch.save files are loaded
with ``map_location="cpu"``). Writers add little: fp-dcp its staging buffers
(128 MiB by default), torch.save and DCP nothing proportional to the state;
safetensors releases before 0.6 copy each tensor to ``bytes`` while saving,
up to twice the state. Tensors that share storage (tied weights) are cloned
for safetensors, which refuses shared tensors. Run one conversion process on
a machine with more free memory than the checkpoint's tensor bytes.

Trust: DCP metadata and torch.save files are pickles, and converting them
runs their unpickling (``torch.load(weights_only=False)``, as DCP does):
convert only checkpoints you trust.

Progress of the read, the part that grows with the checkpoint, goes to the
``fp_dcp`` logger as that of saves and loads does (``fp_dcp.progress``: INFO,
every few seconds, bytes, GB/s, ETA; silent unless the application enables
it) and to an optional callback ``progress(bytes_done, bytes_total)``. Stage
messages go to the ``fp_dcp.convert`` logger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from torch.distributed.checkpoint import format_utils
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_saver import save

from .. import FastPersistReader, FastPersistWriter, SafetensorsWriter, compat
from ..checkpoint import is_safetensors_directory, open_checkpoint, published_files
from ..errors import CheckpointExistsError, CorruptCheckpointError, NotACheckpointError
from ..io.files import fsync_directory, replace_durably
from ..io.progress import Progress, ProgressCallback
from ..names import METADATA_NAME
from ..safetensors_format import INDEX_NAME, SUFFIX, parse_index
from ..structure import nesting_fault

__all__ = [
    "FORMATS",
    "ConvertSummary",
    "Format",
    "convert",
    "detect_format",
    "read_state_dict",
    "MAX_SHARD_SIZE",
    "parse_size",
    "shard_mapping",
]

Format = Literal["fp", "dcp", "torch", "safetensors"]
FORMATS: tuple[Format, ...] = ("fp", "dcp", "torch", "safetensors")
log = logging.getLogger(__name__)

MAX_SHARD_SIZE = "5GB"  # Hugging Face's default (huggingface_hub, transformers' save_pretrained)
_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}

# Without a process group DCP warns on every call that it assumes a single process; that is the point here.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"


@dataclasses.dataclass(frozen=True)
class ConvertSummary:
    """What ``convert`` did."""

    source_format: Format
    target_format: Format
    tensors: int  # tensor entries written
    bytes: int  # their bytes
    seconds: float
    dropped: tuple[str, ...]  # non-tensor entries left out (safetensors holds tensors only)


def detect_format(path: str | os.PathLike[str]) -> Format:
    """The format of a checkpoint directory or file, from its contents (not its name)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return "safetensors" if is_safetensors_directory(path) else open_checkpoint(path).kind
    if not os.path.isfile(path):
        raise NotACheckpointError(f"{path} does not exist")
    with open(path, "rb") as f:
        head = f.read(9)
    # safetensors: an 8-byte little-endian header length, then the JSON header.
    if len(head) == 9 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") <= os.path.getsize(path) - 8:
        return "safetensors"
    return "torch"  # torch.load says precisely what is wrong if it is not


class _CountingPlanner(compat.EmptyStateDictLoadPlanner):
    """DCP's empty-state-dict planner, counting each tensor's bytes as the reader commits it (stock
    checkpoints too, whose reads fp-dcp's own load progress does not see)."""

    def __init__(self, what: str, callback: ProgressCallback | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self._what = what
        self._callback = callback
        self.progress: Progress | None = None

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is not None:
            self.progress = Progress(self._what, _tensor_totals(metadata)[1], callback=self._callback)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.progress is not None:
            self.progress.advance(tensor.nbytes)


def read_state_dict(
    path: str | os.PathLike[str],
    *,
    data_dirs: Sequence[str | os.PathLike[str]] | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """The whole state dict stored at ``path`` (any of ``FORMATS``), in host memory.

    ``data_dirs``: those an fp-dcp checkpoint was saved with, if any. Memory:
    one full copy of the state dict (see the module's docstring).
    """
    path = os.fspath(path)
    kind = detect_format(path)
    if kind == "torch":
        loaded = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state dict")
        return loaded
    if kind == "safetensors" and os.path.isfile(path):
        return dict(_safetensors().load_file(path))
    state: dict[str, Any] = {}
    planner = _CountingPlanner(f"convert, reading {path}", progress)
    with FastPersistReader(path, data_dirs=data_dirs) as reader, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        # Once outside DCP, which would bury an error here (missing data_dirs, say) in one of its own.
        fault = nesting_fault(reader.read_metadata())
        if fault is not None:  # DCP's planner would overwrite one value with another, or fail halfway
            raise CorruptCheckpointError(f"{path}: {fault}")
        with _own_errors():
            compat.load_state_dict_no_dist(state, reader, planner)
    if planner.progress is not None:
        planner.progress.finish()
    return state


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Format,
    data_dirs: Sequence[str | os.PathLike[str]] | None = None,
    overwrite: bool = False,
    drop_non_tensors: bool = False,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    progress: ProgressCallback | None = None,
) -> ConvertSummary:
    """Write the checkpoint or file at ``src`` to ``dst`` in format ``to``.

    Args:
        src: a checkpoint directory or a file in any of ``FORMATS``.
        dst: the directory (``fp``, ``dcp``, ``safetensors``) or file (``torch``, and ``safetensors`` for a
            name ending in ``.safetensors`` or an existing file) to create.
        to: the target format.
        data_dirs: the ``data_dirs`` an fp-dcp ``src`` was saved with, if any.
        overwrite: replace an existing ``dst``; without it an existing one is an error.
        drop_non_tensors: for safetensors, which stores tensors only, leave out
            the non-tensor entries (they are listed in the summary) instead of
            refusing to convert.
        max_shard_size: for a safetensors directory, the most tensor bytes per
            file, in bytes or as Hugging Face writes it (``"5GB"``, ``"500MB"``,
            ``"2GiB"``); a larger tensor gets a file of its own.
        progress: called with ``(bytes_done, bytes_total)`` while a checkpoint
            directory is read.

    Memory: the whole state dict in host memory (see the module's docstring).
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if to not in FORMATS:
        raise ValueError(f"unknown target format {to!r}; choose one of {', '.join(FORMATS)}")
    source = detect_format(src)
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ValueError(f"source and destination are the same path: {src}")
    shard_bytes = parse_size(max_shard_size)
    _check_destination(dst, to, overwrite)
    start = time.perf_counter()
    if source == "torch" and to == "dcp":
        _remove_checkpoint(dst)
        log.info("fp-dcp convert: %s to a DCP checkpoint with torch's format_utils.torch_save_to_dcp", src)
        with warnings.catch_warnings(), _own_errors():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
            format_utils.torch_save_to_dcp(src, dst)
        count, nbytes = _tensor_totals(open_checkpoint(dst).metadata)
        return ConvertSummary(source, to, count, nbytes, time.perf_counter() - start, ())
    state = read_state_dict(src, data_dirs=data_dirs, progress=progress)
    log.info("fp-dcp convert: writing %s (%s)", dst, to)
    dropped: tuple[str, ...] = ()
    if to == "safetensors":
        state, dropped = _tensors_only(state, drop_non_tensors, src)
    flat, _ = compat.flatten_state_dict(state)
    tensors = [v for v in flat.values() if isinstance(v, torch.Tensor)]
    if to in ("fp", "dcp"):
        _write_checkpoint(state, dst, to, overwrite)
    elif to == "safetensors" and not _one_file(dst):
        _write_safetensors_directory(state, dst, shard_bytes)
    else:
        _write_file(state, dst, to)
    seconds = time.perf_counter() - start
    log.info("fp-dcp convert: %s (%s) to %s (%s) in %.1f s", src, source, dst, to, seconds)
    return ConvertSummary(source, to, len(tensors), sum(t.nbytes for t in tensors), seconds, dropped)


@contextlib.contextmanager
def _own_errors() -> Iterator[None]:
    """Raise the error our one rank hit instead of DCP's CheckpointException around it.

    That one is a BaseException (``except Exception`` misses it) whose text is
    every rank's traceback.
    """
    try:
        yield
    except CheckpointException as e:
        failure = next(iter(e.failures.values()), None)
        if failure is None:
            raise
        raise failure[0] from None


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "the safetensors format needs the safetensors package: pip install 'fp-dcp[safetensors]'"
        ) from None
    return safetensors.torch


def _tensor_totals(metadata: Metadata) -> tuple[int, int]:
    sizes = [
        md.size.numel() * md.properties.dtype.itemsize
        for md in metadata.state_dict_metadata.values()
        if isinstance(md, TensorStorageMetadata)
    ]
    return len(sizes), sum(sizes)


def parse_size(size: int | str) -> int:
    """Bytes, from an int or a size as Hugging Face writes one: ``"5GB"`` (10**9), ``"2GiB"`` (2**30), ``"500MB"``."""
    if isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]i?B)?\s*", size, re.IGNORECASE)
        if match is None:
            raise ValueError(f"{size!r} is not a size: give bytes, or a number and KB, MB, GB, TB, KiB, MiB, GiB, TiB")
        size = int(float(match[1]) * _UNITS[(match[2] or "").upper()])
    if size <= 0:
        raise ValueError(f"a shard size must be positive, not {size}")
    return size


def shard_mapping(tensors: dict[str, torch.Tensor], max_shard_size: int) -> dict[str, int]:
    """The file (1 to N) of each tensor, by Hugging Face's rule (see the module's docstring)."""
    mapping: dict[str, int] = {}
    index, used = 1, 0
    for name, tensor in tensors.items():
        if used and used + tensor.nbytes > max_shard_size:
            index, used = index + 1, 0
        mapping[name] = index
        used += tensor.nbytes
    return mapping


def _one_file(dst: str) -> bool:
    """A safetensors destination that is one file rather than a directory of shards."""
    return dst.endswith(SUFFIX) or os.path.isfile(dst)


def _check_destination(dst: str, to: Format, overwrite: bool) -> None:
    if not os.path.lexists(dst):
        return
    is_dir = os.path.isdir(dst)
    if (to in ("fp", "dcp") or (to == "safetensors" and not _one_file(dst))) and not is_dir:
        raise NotADirectoryError(f"{dst} exists and is not a directory; a {to} checkpoint is a directory")
    if (to == "torch" or (to == "safetensors" and _one_file(dst))) and is_dir:
        raise IsADirectoryError(
            f"{dst} is a directory; a {to} file is one file (name a directory without .safetensors)"
        )
    if not overwrite and (not is_dir or os.listdir(dst)):
        raise CheckpointExistsError(f"{dst} exists and is not empty; pass overwrite=True (--force) to replace it")


def _remove_checkpoint(directory: str) -> None:
    """Remove the checkpoint published in ``directory``, before a stock DCP save replaces it.

    FileSystemWriter overwrites only the files it writes; those of the old
    checkpoint it does not would stay behind. Files that are no checkpoint's
    are left alone.
    """
    if not os.path.isdir(directory):
        return
    for name in [METADATA_NAME, *published_files(directory)]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def _tensors_only(state: dict[str, Any], drop: bool, src: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The flat ``{fqn: tensor}`` dict safetensors stores: contiguous, no two sharing memory."""
    flat, _ = compat.flatten_state_dict(state)
    others = tuple(k for k, v in flat.items() if not isinstance(v, torch.Tensor))
    if others and not drop:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ValueError(
            f"{src} holds non-tensor entries that safetensors cannot store ({shown}); "
            "pass drop_non_tensors=True (--drop-non-tensors) to convert the tensors alone"
        )
    seen: set[int] = set()
    tensors: dict[str, Any] = {}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        value = value.detach().cpu().contiguous()
        storage = value.untyped_storage().data_ptr()
        if storage in seen and value.numel():
            value = value.clone()  # tied weights: safetensors refuses tensors that share memory
        seen.add(storage)
        tensors[key] = value
    if others:
        log.warning("fp-dcp convert: safetensors stores tensors only; left out %s", ", ".join(others))
    return tensors, others


def _write_checkpoint(state: dict[str, Any], dst: str, to: Format, overwrite: bool) -> None:
    with warnings.catch_warnings(), _own_errors():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        if to == "fp":
            with FastPersistWriter(dst, overwrite=overwrite) as writer:
                save(state, storage_writer=writer, no_dist=True)
        else:
            _remove_checkpoint(dst)
            save(state, storage_writer=FileSystemWriter(dst), no_dist=True)


def _write_safetensors_directory(tensors: dict[str, Any], dst: str, max_shard_size: int) -> None:
    """Shards and index through ``SafetensorsWriter``, into a directory beside ``dst``, then put in place."""
    parent = os.path.dirname(os.path.abspath(dst))
    staging = os.path.join(parent, f".{os.path.basename(os.path.abspath(dst))}.{secrets.token_hex(4)}.tmp")
    os.mkdir(staging)  # with the umask's permissions, which the destination keeps
    try:
        with (
            SafetensorsWriter(staging, fqn_to_index_mapping=shard_mapping(tensors, max_shard_size)) as writer,
            warnings.catch_warnings(),
            _own_errors(),
        ):
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
            save(tensors, storage_writer=writer, no_dist=True)
        if not os.path.isdir(dst) or not os.listdir(dst):
            os.replace(staging, dst)  # a new (or empty) directory: the whole checkpoint appears at once
        else:
            _remove_checkpoint(dst)
            _remove_safetensors(dst)
            for name in sorted(os.listdir(staging), key=lambda n: n == INDEX_NAME):  # the index last
                os.replace(os.path.join(staging, name), os.path.join(dst, name))
            fsync_directory(dst)
        fsync_directory(parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_safetensors(directory: str) -> None:
    """Remove the safetensors checkpoint in ``directory`` (its index first); its other files stay."""
    index = os.path.join(directory, INDEX_NAME)
    try:
        with open(index, "rb") as f:
            names = set(parse_index(f.read(), index).values())
    except (FileNotFoundError, CorruptCheckpointError):  # no index, or a damaged one: every file was the checkpoint
        names = {name for name in os.listdir(directory) if name.endswith(SUFFIX)}
    own = sorted(n for n in names if os.path.basename(n) == n and n.endswith(SUFFIX))  # nothing outside it
    for name in [INDEX_NAME, *own]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def _write_file(state: dict[str, Any], dst: str, to: Format) -> None:
    """Write under a temporary name, fsync, rename: ``dst`` is never a half-written file."""

    def write(tmp: str) -> None:
        if to == "torch":
            torch.save(state, tmp)
        else:
            _safetensors().save_file(state, tmp)

    replace_durably(dst, f"{dst}.{os.getpid()}.tmp", write)
