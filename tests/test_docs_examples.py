"""The examples in README.md and docs/*.md run, so they cannot rot.

What runs is decided by each fenced block's info string (the text after the
opening backticks), nothing else:

- ``python``: executed. The blocks of one file run in order in one namespace.
  What a block prints (stdout) must match the ``output`` block directly after
  it (nothing but blank lines between them). A block that prints without an
  ``output`` block after it fails, so a doc cannot silently drift from what
  its examples print. There is deliberately no way to print unseen: an
  example whose output cannot be pinned down asserts instead of printing.
- ``output``: what the ``python`` block directly before it prints. An
  ``output`` block anywhere else fails the test. ``output exact``: the same,
  and its numbers must match too (below).
- ``console``: each line ``$ fp-dcp ARGS`` is run (in-process, through
  ``fp_dcp.tools.cli.main``) and what it prints, stdout and stderr together, must
  match the lines below it up to the next ``$``. ``# exit N`` at the end of
  a command line is the exit status it must have (default 0). Only
  ``fp-dcp`` commands may appear: set things up in a python block.
- anything else (``sh``, ``text``, ``python notest``, no info string): shown
  to readers, not run. Use ``python notest`` for a Python sketch that cannot
  run on its own (a fragment of a multi-rank training script, say).

Output matches the doc line by line, with numbers, hex digests and UUIDs
ignored, as are differences in spacing; a line ``...`` matches any number of
lines. In an ``output exact`` block only UUIDs and words of 8 or 16 hex
digits (a save's token in a file name, a data subdirectory's hash) are
ignored: every other number must be what the block printed, so a figure
such as a file's size is checked, not only the shape of the line.

Each file runs in a fresh temporary directory, its working directory, which
holds two checkpoints: ``step-100``, saved by one rank (with a nested key
holding a dot, a 0-d and a 0-length tensor, and objects stored as bytes),
and ``step-200``, saved by two ranks with data directories ``disk0`` and
``disk1`` (in the working directory too), ``lanes_per_dir=2`` and
``FastPersistSavePlanner``, which cuts one tensor into row chunks, in
another directory and copied here (a moved tree). The blocks see
``saved``: the state dicts the two were saved from, by name, to compare
what they read with. The prefix ``/nvme/`` in python blocks (the docs'
example mount point of a fast disk) is rewritten to that directory, and the
modules ``crc32c`` and ``xxhash`` (the PyPI packages docs/format.md names)
are fp-dcp's own CRC-32C and XXH3-128 if the packages are not installed:
they compute the same functions.
Run with ``-s`` to see which blocks ran.

examples/read_checkpoint.py, a reader written from docs/format.md alone,
finds data files by the rules docs/reading.md gives for checkpoints that
moved; they are checked against fp-dcp's own, case by case: it must find
the same files, or refuse the same checkpoints with the same verdict, as
``fp_dcp.checkpoint.open_checkpoint``. (tests/test_reading_example.py
checks what it reads.)

The scripts in examples/ that a test here names run as a user runs them, in
a process of their own; examples/durable_s3.py against a real S3 server
(SeaweedFS), started for it and stopped by its process id.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_bad_input import rewrite_footer
from tiers_util import seaweedfs

from fp_dcp import FastPersistSavePlanner, FastPersistWriter, compat
from fp_dcp._native import _cio
from fp_dcp.checkpoint import open_checkpoint
from fp_dcp.errors import CheckpointError
from fp_dcp.testing.ranks import run_ranks
from fp_dcp.tools import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
RUN = {"python", "console"}
OUTPUT = {"output", "output exact"}
EXAMPLE = ROOT / "examples" / "read_checkpoint.py"


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the first line of code, 1-based
    info: str
    text: str
    adjacent: bool  # only blank lines separate it from the block before
    needs: str = ""  # "torch>=2.9" ending the info string: a block that runs only on that torch or newer

    @property
    def where(self) -> str:
        return f"{os.path.relpath(self.doc, ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    found = []
    lines = doc.read_text().splitlines()
    i = 0
    prose = True  # whether anything but blank lines came since the last block
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i])
        if not m:
            prose = prose or bool(lines[i].strip())
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2).strip(), i + 1
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            i += 1
        required = re.fullmatch(r"(.*?)\s+(torch>=\d+\.\d+)", info)  # e.g. "python torch>=2.9"
        info, needs = (required.group(1), required.group(2)) if required else (info, "")
        found.append(Block(doc, start + 1, info, "\n".join(lines[start:i]) + "\n", not prose, needs))
        prose = False
        i += 1
    return found


def normalise(line: str, exact: bool = False) -> str:
    line = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<uuid>", line)
    if exact:  # a save's token, a data subdirectory's hash: new at every run
        line = re.sub(r"\b([0-9a-f]{16}|[0-9a-f]{8})\b", "<hex>", line)
    else:
        line = re.sub(r"\b[0-9a-f]{8,}\b", "<hex>", line)
        line = re.sub(r"\d+(\.\d+)?", "0", line)
    return " ".join(line.split())


def matches(expected: list[str], actual: list[str], exact: bool = False) -> bool:
    """Whether ``actual`` fits ``expected``, where a ``...`` line stands for any lines (``exact``: numbers too)."""
    exp = [None if e.strip() == "..." else normalise(e, exact) for e in expected]
    act = [normalise(a, exact) for a in actual]
    # can[i][j]: expected[i:] matches actual[j:]
    can = [[False] * (len(act) + 1) for _ in range(len(exp) + 1)]
    can[len(exp)][len(act)] = True
    for i in range(len(exp) - 1, -1, -1):
        for j in range(len(act), -1, -1):
            if exp[i] is None:
                can[i][j] = can[i + 1][j] or (j < len(act) and can[i][j + 1])
            else:
                can[i][j] = j < len(act) and exp[i] == act[j] and can[i + 1][j + 1]
    return can[0][0]


def assert_prints(where: str, what: str, output: str, expected: list[str], exact: bool = False) -> None:
    while expected and not expected[-1].strip():
        expected = expected[:-1]
    assert matches(expected, output.rstrip("\n").splitlines(), exact), (
        f"{where}: {what} printed\n{output}\nwhich does not match the doc's\n" + "\n".join(expected)
    )


def run_cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = cli.main(argv)
        except SystemExit as e:  # --help and argument errors
            status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return status, out.getvalue()


def run_console(block: Block) -> None:
    commands: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
        elif line.strip():
            raise AssertionError(f"{block.where}: output before any '$ ' command")
    assert commands, f"{block.where}: a console block without a '$ fp-dcp' command"
    for command, expected in commands:
        m = re.match(r"^(.*?)\s+#\s*exit\s+(\d+)\s*$", command)
        line, want = (m.group(1), int(m.group(2))) if m else (command, 0)
        argv = shlex.split(line)
        assert argv[0] == "fp-dcp", f"{block.where}: only fp-dcp commands run in console blocks, not {argv[0]!r}"
        status, output = run_cli(argv[1:])
        assert status == want, f"{block.where}: `{command}` exited {status}, the doc says {want}:\n{output}"
        assert_prints(block.where, f"`{command}`", output, expected)


def run_python(block: Block, sandbox: Path, namespace: dict[str, Any], shown: Block | None) -> None:
    """Execute the block; what it prints must match ``shown``, its output block (if None: nothing)."""
    code = block.text.replace("/nvme/", f"{sandbox}/nvme/")
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        exec(compile("\n" * (block.line - 1) + code, str(block.doc), "exec"), namespace)
    if shown is None:
        assert not out.getvalue(), (
            f"{block.where}: the block prints, so an ```output block must follow it with\n{out.getvalue()}"
        )
    else:
        assert_prints(block.where, "the block", out.getvalue(), shown.text.splitlines(), shown.info == "output exact")


def run_doc(doc: Path, sandbox: Path, namespace: dict[str, Any]) -> list[str]:
    """Run the doc's blocks in order, checking what they print; returns where each ran."""
    ran = []
    found = blocks(doc)
    for i, block in enumerate(found):
        if block.info in OUTPUT:
            assert block.adjacent and i > 0 and found[i - 1].info == "python", (
                f"{block.where}: an output block must directly follow a python block"
            )
        if block.info not in RUN or not torch_is(block.needs):
            continue
        if block.info == "python":
            after = found[i + 1] if i + 1 < len(found) else None
            shown = after if after is not None and after.info in OUTPUT and after.adjacent else None
            run_python(block, sandbox, namespace, shown)
            ran.append(f"{block.where} python" + (" + output" if shown else ""))
        else:
            run_console(block)
            ran.append(f"{block.where} console")
    return ran


def torch_is(needs: str) -> bool:
    """Whether this torch meets a block's ``torch>=X.Y`` (an empty one: always)."""
    if not needs:
        return True
    major, minor = needs.removeprefix("torch>=").split(".")
    return compat.TORCH >= (int(major), int(minor))


def xxh3_128_hexdigest(data: bytes) -> str:
    hasher = _cio.Hash128()
    hasher.update(data)
    return hasher.hexdigest()


def save_on_rank(rank: int, world: int, path: str, data_dirs: list[str], state: dict[str, Any]) -> None:
    writer = FastPersistWriter(path, data_dirs=data_dirs, lanes_per_dir=2)
    dcp.save(state, storage_writer=writer, planner=FastPersistSavePlanner(split_bytes=1024, chunks_per_rank=2))


@pytest.fixture(scope="session")
def two_rank_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A directory holding step-200, disk0 and disk1, and the state saved there; made once (spawning ranks is slow)."""
    root = tmp_path_factory.mktemp("two-ranks")
    state = {
        "embed": torch.randn(64, 8),  # over split_bytes: cut into 2 ranks x chunks_per_rank row chunks
        "model": {"norm.weight": torch.rand(16).to(torch.bfloat16), "scale": torch.tensor(0.5)},
        "optim": {"step": 7, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95)}]},
    }
    run_ranks(2, save_on_rank, str(root / "step-200"), [str(root / "disk0"), str(root / "disk1")], state)
    return root, state


def stand_in_for_hash_packages(monkeypatch) -> None:
    """fp-dcp's own CRC-32C and XXH3-128 as the PyPI packages docs/format.md names, if those are not installed."""
    if importlib.util.find_spec("crc32c") is None:
        monkeypatch.setitem(sys.modules, "crc32c", types.SimpleNamespace(crc32c=_cio.crc32c))
    if importlib.util.find_spec("xxhash") is None:
        monkeypatch.setitem(sys.modules, "xxhash", types.SimpleNamespace(xxh3_128_hexdigest=xxh3_128_hexdigest))


def reading_example(monkeypatch) -> types.ModuleType:
    """examples/read_checkpoint.py as a module (fp-dcp's own CRC-32C and XXH3-128 where the packages are missing)."""
    stand_in_for_hash_packages(monkeypatch)
    spec = importlib.util.spec_from_file_location("read_checkpoint", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def sandbox(tmp_path, monkeypatch, two_rank_checkpoint) -> tuple[Path, dict[str, Any]]:
    """The docs' working directory, and the state dicts of the checkpoints in it."""
    monkeypatch.chdir(tmp_path)
    stand_in_for_hash_packages(monkeypatch)
    state = {
        "w": torch.randn(300, 70).to(torch.bfloat16),
        "b": torch.arange(5),
        "extra": {"step": 3},
        "model": {"empty": torch.zeros(0, 4), "norm.weight": torch.ones(8), "scale": torch.tensor(2.5)},
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "step-100"))
    template, state_200 = two_rank_checkpoint
    shutil.copytree(template, tmp_path, dirs_exist_ok=True)
    return tmp_path, {"step-100": state, "step-200": state_200}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_doc_examples_run(doc, sandbox):
    directory, saved = sandbox
    ran = run_doc(doc, directory, {"__name__": "__doc_example__", "saved": saved})
    print(f"\n{doc.relative_to(ROOT)}: ran {len(ran)} blocks: {', '.join(ran) or 'none'}")


def arrange(case: str, tmp: Path) -> tuple[str, list[str] | None]:
    """A checkpoint laid out under ``tmp``, the working directory, as ``case`` says: (its path, data_dirs to give)."""
    state = {"w": torch.randn(64, 64), "o": {"x": 1}}
    if case == "incremental, moved":
        writer = FastPersistWriter(incremental=True, data_dirs=[tmp / "run" / "d0"])
        dcp.save(state, checkpoint_id=tmp / "run" / "s1", storage_writer=writer)
        writer.base = tmp / "run" / "s1"
        dcp.save(state, checkpoint_id=tmp / "run" / "s2", storage_writer=writer)  # references s1's w
        shutil.move(tmp / "run", tmp / "moved")
        return "moved/s2", None
    dirs = [tmp / "run" / "d0", tmp / "run" / "d1"]
    dcp.save(state, storage_writer=FastPersistWriter(tmp / "run" / "ck", data_dirs=dirs, lanes_per_dir=2))
    if case.startswith("relative"):  # as an older fp-dcp recorded them, saving from `run`
        rewrite_footer(tmp / "run" / "ck", data_dirs=["d0", "d1"])
        if case == "relative, in the working directory":
            for d in dirs:
                shutil.move(d, tmp)
        elif case == "relative, nowhere":
            for d in dirs:
                shutil.rmtree(d)
        return "run/ck", None
    if case == "in place":
        return "run/ck", None
    shutil.move(tmp / "run", tmp / "moved")
    subdir = open_checkpoint(tmp / "moved" / "ck", [tmp / "moved" / "d0", tmp / "moved" / "d1"]).footer["data_subdir"]
    if case == "moved, through a symlink":
        (tmp / "link").mkdir()
        (tmp / "link" / "ck").symlink_to(tmp / "moved" / "ck")
        return "link/ck", None
    if case.startswith("gathered"):
        into = tmp / "moved" / "ck" / (subdir if case == "gathered under the subdirectory" else "")
        into.mkdir(exist_ok=True)
        for d in ("d0", "d1"):
            for f in (tmp / "moved" / d / subdir).iterdir():
                shutil.move(f, into)
        return "moved/ck", None
    if case == "short copy first":
        original = next((tmp / "moved" / "d0" / subdir).iterdir())
        shutil.copytree(tmp / "moved" / "d0", tmp / "run" / "d0")  # the recorded place holds a whole copy, found later
        os.truncate(original, 10)
        return "moved/ck", None
    if case == "given, one not there":
        return "moved/ck", ["moved/d0", "moved/gone"]
    given = {"given": 2, "given, too few": 1, "given, more": 3, "given, none": 0}
    return "moved/ck", [f"moved/d{i}" for i in range(given[case])] if case in given else None


FINDING_CASES = [
    "in place",
    "moved",
    "moved, through a symlink",
    "given",
    "given, too few",
    "given, more",
    "given, none",
    "given, one not there",
    "gathered beside .metadata",
    "gathered under the subdirectory",
    "short copy first",
    "relative, beside the checkpoint",
    "relative, in the working directory",
    "relative, nowhere",
    "incremental, moved",
]


@pytest.mark.parametrize("case", FINDING_CASES)
def test_reading_guide_finds_the_data_files_fp_dcp_finds(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = reading_example(monkeypatch)
    path, data_dirs = arrange(case, tmp_path)
    # the example's verdicts, and the errors docs/reading.md says fp-dcp raises for them
    errors = {
        example.NotACheckpoint: "NotACheckpointError",
        example.DataDirectoryNotFound: "DataDirectoryNotFoundError",
        example.Damage: "CorruptCheckpointError",
    }

    def found(where: Any) -> dict[str, str] | str:
        try:
            return {name: os.path.normpath(p) for name, p in where().items()}
        except example.Refused as e:
            return f"refused: {errors[type(e)]}"
        except CheckpointError as e:
            return f"refused: {type(e).__name__}"

    footer, md = example.read_metadata(path)
    by_example = found(lambda: example.data_file_paths(path, footer, md, data_dirs))
    by_fp_dcp = found(lambda: open_checkpoint(path, data_dirs).files)
    assert by_example == by_fp_dcp, (by_example, by_fp_dcp)
    refused = {"given, too few", "given, one not there", "relative, nowhere"}
    assert isinstance(by_fp_dcp, str) == (case in refused), by_fp_dcp


@pytest.mark.slow
def test_durable_store_example(tmp_path):
    """examples/durable_s3.py with the endpoint and credentials as FsspecStore options, none in the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = str(ROOT)  # this tree's fp_dcp, whatever is installed
    with seaweedfs() as s3:
        options = ["--endpoint", s3["AWS_ENDPOINT_URL"], "--key", s3["AWS_ACCESS_KEY_ID"]]
        options += ["--secret", s3["AWS_SECRET_ACCESS_KEY"]]
        example = [sys.executable, str(ROOT / "examples" / "durable_s3.py"), "--bucket", "fp-dcp", *options]
        run = subprocess.run(example, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    saved, restored = run.stdout.splitlines()
    # the drain of step 2 may still wait for step 1's when step 3 is saved: then only 1 and 3 are drained
    assert re.fullmatch(r"saved steps 1, 2, 3; s3://fp-dcp/fp-dcp-example holds steps \[[12], 3\]", saved), saved
    assert restored == "local root deleted; restored step 3 from s3://fp-dcp/fp-dcp-example: bit-exact", restored
    assert "1 file(s) from durable storage" in run.stderr  # the local root was empty: the bucket was read


def test_matching_rules():
    assert matches(["a 1.5 GB/s", "...", "end"], ["a   2.25 GB/s", "x", "y", "end"])
    assert matches(["...", "tail"], ["tail"])
    assert not matches(["a", "b"], ["a", "c"])
    assert not matches(["a"], ["a", "extra"])
    assert normalise("__0_0.3f9c0a1b2c4d5e6f.distcp") == normalise("__0_0.0123456789abcdef.distcp")
    assert normalise("model.w") != normalise("model.b")
    assert matches(["size 45056"], ["size 126976"]) and not matches(["size 45056"], ["size 126976"], exact=True)
    assert matches(["__0_0.3f9c0a1b2c4d5e6f.distcp 4096"], ["__0_0.0123456789abcdef.distcp 4096"], exact=True)
    assert matches(["d0/step-2-5f1c2a9e", "0.0003"], ["d0/step-2-01234567", "0.0003"], exact=True)
    assert not matches(["__0_0.3f9c0a1b2c4d5e6f.distcp"], ["__0_1.3f9c0a1b2c4d5e6f.distcp"], exact=True)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("```python\nprint('model.w: 3 items')\n```\n\n```output\nmodel.w: 4 items\n```\n", None),
        ("```python\nx = 1\n```\n```output\n```\n", None),
        ("```python\nprint('model.w')\n```\n```output\nmodel.b\n```\n", "which does not match the doc's"),
        ("```python\nprint('model.w')\n```\n```output\nmodel.w\nmodel.b\n```\n", "which does not match the doc's"),
        ("```python\nprint('w: 4 items')\n```\n```output exact\nw: 4 items\n```\n", None),
        ("```python\nprint('w: 3 items')\n```\n```output exact\nw: 4 items\n```\n", "which does not match the doc's"),
        ("```python\nx = 1\n```\nIt prints\n```output exact\n```\n", "must directly follow a python block"),
        ("```python\nprint('model.w')\n```\n", "an ```output block must follow it"),
        ("```python\nprint('model.w')\n```\nIt prints\n```output\nmodel.w\n```\n", "an ```output block must follow"),
        ("```python\nx = 1\n```\nIt prints\n```output\n```\n", "must directly follow a python block"),
        ("```python notest\nprint(1)\n```\n```output\n1\n```\n", "must directly follow a python block"),
        ("```output\nmodel.w\n```\n", "must directly follow a python block"),
    ],
    ids=[
        "match",
        "silent",
        "differs",
        "missing-line",
        "exact",
        "exact-number-differs",
        "exact-orphan",
        "no-output",
        "prose-between",
        "orphan",
        "notest",
        "first",
    ],
)
def test_output_blocks_are_checked(tmp_path, monkeypatch, text, error):
    monkeypatch.chdir(tmp_path)
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    if error is None:
        run_doc(doc, tmp_path, {})
    else:
        with pytest.raises(AssertionError, match=re.escape(error)):
            run_doc(doc, tmp_path, {})
