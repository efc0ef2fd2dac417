"""The reading recipe in docs/format.md works on a real checkpoint, with nothing but the doc."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import torch
from conftest import save

from fp_dcp import _cio

DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


def test_format_doc_recipe_reads_and_verifies_every_item(tmp_path, monkeypatch):
    state = {"w": torch.randn(300, 70).to(torch.bfloat16), "b": torch.arange(5), "extra": {"step": 3}}
    save(state, tmp_path / "step-100")
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    # The recipe names the crc32c package from PyPI; the extension computes the same function.
    monkeypatch.setitem(sys.modules, "crc32c", types.SimpleNamespace(crc32c=_cio.crc32c))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # asserts every checksum on the way
    md = scope["md"]
    index = next(i for i in md.storage_data if i.fqn == "w")
    file, offset, length, _ = md.storage_data[index]
    raw = (tmp_path / "step-100" / file).read_bytes()[offset : offset + length]
    rebuilt = torch.frombuffer(bytearray(raw), dtype=md.state_dict_metadata["w"].properties.dtype).reshape(300, 70)
    assert torch.equal(rebuilt, state["w"])
