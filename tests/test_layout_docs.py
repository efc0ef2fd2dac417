"""README's Layout section and design.md's module map name what the tree holds, no more and no less."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fp_dcp"


def tracked_top_level_dirs() -> set[str]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return {n.split("/")[0] for n in names if "/" in n and not n.startswith(".")}


def readme_layout() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Layout") :]


def test_readme_layout_names_every_top_level_folder_and_subpackage():
    layout = readme_layout()
    named = set(re.findall(r"`([a-z_]+)/`", layout))
    assert tracked_top_level_dirs() <= named, tracked_top_level_dirs() - named
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages <= named, subpackages - named
    assert named <= tracked_top_level_dirs() | subpackages, named - tracked_top_level_dirs() - subpackages


def test_design_module_map_names_every_module():
    text = (ROOT / "docs" / "design.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    modules -= {"__main__.py"}
    covered = {m for m in modules if m in rows or f"{m.split('/')[0]}/*.py" in rows}
    assert covered == modules, sorted(modules - covered)
    listed = {r for r in rows if r.endswith(".py") and "*" not in r}
    assert all((PACKAGE / r).exists() for r in listed), sorted(r for r in listed if not (PACKAGE / r).exists())


def test_benchmarks_readme_has_a_row_for_every_script():
    """benchmarks/README.md: one table row per script (Python or shell) in benchmarks/, and none for a script that
    is not there."""
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "benchmarks"]  # new ones too
    names = subprocess.run(listed, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    scripts = {n.removeprefix("benchmarks/") for n in names if n.endswith((".py", ".sh"))}
    scripts = {s for s in scripts if (ROOT / "benchmarks" / s).exists()}  # not deleted in the working tree
    text = (ROOT / "benchmarks" / "README.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    # torch_dcp_suite's shim and site hook are named in its run.py's row
    named = rows | {s for s in scripts if s.startswith("torch_dcp_suite/") and f"`{s.split('/', 1)[1]}`" in text}
    assert scripts <= named, sorted(scripts - named)
    assert rows <= scripts, sorted(rows - scripts)
