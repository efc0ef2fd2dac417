"""The examples in README.md and docs/*.md run, so they cannot rot.

What runs is decided by each fenced block's info string (the text after the
opening backticks), nothing else:

- ``python``: executed. The blocks of one file run in order in one namespace.
- ``console``: each line ``$ fp-dcp ARGS`` is run (in-process, through
  ``fp_dcp.tools.cli.main``) and what it prints, stdout and stderr together, must
  match the lines below it up to the next ``$``. Numbers, hex digests and
  UUIDs are ignored, as are differences in spacing; a line ``...`` matches
  any number of lines. ``# exit N`` at the end of a command line is the exit
  status it must have (default 0). Only ``fp-dcp`` commands may appear: set
  things up in a python block.
- anything else (``sh``, ``text``, ``python notest``, no info string): shown
  to readers, not run. Use ``python notest`` for a Python sketch that cannot
  run on its own (a fragment of a multi-rank training script, say).

Each file runs in a fresh temporary directory, its working directory, which
holds ``step-100``, a small fp-dcp checkpoint (the name docs/format.md reads).
The prefix ``/nvme/`` in python blocks (the docs' example mount point of a
fast disk) is rewritten to that directory, and the module ``crc32c`` (the
PyPI package docs/format.md names) is fp-dcp's own CRC-32C if the package is
not installed: it computes the same function.
Run with ``-s`` to see which blocks ran.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fp_dcp import FastPersistWriter, _cio
from fp_dcp.tools import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
RUN = {"python", "console"}


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the first line of code, 1-based
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    found = []
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m.group(1), m.group(2).strip(), i + 1
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            i += 1
        found.append(Block(doc, start + 1, info, "\n".join(lines[start:i]) + "\n"))
        i += 1
    return found


def normalise(line: str) -> str:
    line = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<uuid>", line)
    line = re.sub(r"\b[0-9a-f]{8,}\b", "<hex>", line)
    line = re.sub(r"\d+(\.\d+)?", "0", line)
    return " ".join(line.split())


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` fits ``expected``, where a ``...`` line stands for any lines."""
    exp = [None if e.strip() == "..." else normalise(e) for e in expected]
    act = [normalise(a) for a in actual]
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
        while expected and not expected[-1].strip():
            expected.pop()
        got = output.rstrip("\n").splitlines()
        assert status == want, f"{block.where}: `{command}` exited {status}, the doc says {want}:\n{output}"
        assert matches(expected, got), (
            f"{block.where}: `{command}` printed\n{output}\nwhich does not match the doc's\n" + "\n".join(expected)
        )


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if importlib.util.find_spec("crc32c") is None:
        monkeypatch.setitem(sys.modules, "crc32c", types.SimpleNamespace(crc32c=_cio.crc32c))
    state = {"w": torch.randn(300, 70).to(torch.bfloat16), "b": torch.arange(5), "extra": {"step": 3}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "step-100"))
    return tmp_path


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_doc_examples_run(doc, sandbox):
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    ran = []
    for block in blocks(doc):
        if block.info not in RUN:
            continue
        if block.info == "python":
            code = block.text.replace("/nvme/", f"{sandbox}/nvme/")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                exec(compile("\n" * (block.line - 1) + code, str(doc), "exec"), namespace)
        else:
            run_console(block)
        ran.append(f"{block.where} {block.info}")
    print(f"\n{doc.relative_to(ROOT)}: ran {len(ran)} blocks: {', '.join(ran) or 'none'}")


def test_matching_rules():
    assert matches(["a 1.5 GB/s", "...", "end"], ["a   2.25 GB/s", "x", "y", "end"])
    assert matches(["...", "tail"], ["tail"])
    assert not matches(["a", "b"], ["a", "c"])
    assert not matches(["a"], ["a", "extra"])
    assert normalise("__0_0.3f9c0a1b2c4d5e6f.distcp") == normalise("__0_0.0123456789abcdef.distcp")
    assert normalise("model.w") != normalise("model.b")
