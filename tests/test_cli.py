"""The ``fp-dcp`` command: help everywhere, inspect, verify and convert on both kinds of checkpoint, exit codes."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import load, save

from fp_dcp.io.device import filesystem_of
from fp_dcp.io.diskstats import DiskCounters
from fp_dcp.io.progress import progress_text
from fp_dcp.tools import bench, bench_report, fio, plot
from fp_dcp.tools.cli import ProgressBar, build_parser, main
from fp_dcp.tools.inspect import human
from fp_dcp.units import MiB

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["inspect", "verify", "ls", "convert", "bench", "tune"]


def state() -> dict:
    return {
        "model": {"w": torch.randn(300, 70).to(torch.bfloat16), "b": torch.arange(5)},
        "extra": {"step": 3},
    }


@pytest.fixture
def both(tmp_path):
    """The same state saved as an fp-dcp checkpoint and as a torch FileSystemWriter one."""
    s = state()
    save(s, tmp_path / "fp")
    dcp.save(s, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"))
    return {"fp": tmp_path / "fp", "dcp": tmp_path / "stock"}, s


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def data_file(ckpt: Path) -> Path:
    (name,) = [p for p in ckpt.iterdir() if p.suffix == ".distcp"]
    return name


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_everywhere(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: fp-dcp{' ' + command if command else ''} ")
    if command is None:
        assert all(c in out for c in COMMANDS)
    if command == "bench":
        assert "--plot" in out and "--size-gb" in out


def test_every_command_is_documented_with_an_example():
    doc = (ROOT / "docs" / "cli.md").read_text()
    choices = build_parser()._subparsers._group_actions[0].choices
    assert sorted(choices) == sorted(COMMANDS)
    for command in COMMANDS:
        assert f"$ fp-dcp {command} " in doc, command


@pytest.mark.slow
def test_installed_as_console_script_and_module(tmp_path):
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="fp-dcp")
    assert entry.value == "fp_dcp.tools.cli:main"
    out = subprocess.run(
        [sys.executable, "-m", "fp_dcp", "--version"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == f"fp-dcp {importlib.metadata.version('fp-dcp')}"


def test_bad_arguments_exit_2(capsys):
    for argv in ([], ["inspect"], ["convert", "a", "b", "--to", "onnx"], ["inspect", "x", "--bogus"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv
    assert "usage: fp-dcp" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["fp", "dcp"])
def test_inspect_table_and_json(both, kind, capsys):
    paths, s = both
    assert main(["inspect", str(paths[kind])]) == 0
    table = capsys.readouterr().out
    for fqn, dtype in (("model.w", "bfloat16"), ("model.b", "int64"), ("extra.step", "object")):
        assert any(line.split()[:2] == [fqn, dtype] for line in table.splitlines()), fqn
    assert "totals: 3 items (2 tensors, 1 object)" in table

    assert main(["inspect", str(paths[kind]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == kind
    assert info["writer"] == ("fp-dcp FastPersistWriter" if kind == "fp" else "torch FileSystemWriter")
    assert info["format_version"] == (2 if kind == "fp" else None)  # version 3 only with references
    items = {item["fqn"]: item for item in info["items"]}
    assert items["model.w"]["shape"] == [300, 70] and items["model.w"]["chunks"] == 1
    on_disk = {p.name: p.stat().st_size for p in paths[kind].iterdir() if p.suffix == ".distcp"}
    assert info["files"] == on_disk
    assert all(set(item["files"]) <= set(on_disk) for item in items.values())
    if kind == "fp":  # raw bytes: exactly the tensors' sizes
        assert items["model.w"]["bytes"] == s["model"]["w"].nbytes and items["model.b"]["bytes"] == 40
    assert info["totals"]["bytes"] == sum(item["bytes"] for item in items.values())
    assert info["totals"]["file_bytes"] == sum(on_disk.values())


@pytest.mark.parametrize("kind", ["fp", "dcp"])
def test_verify_intact_exits_0(both, kind, capsys):
    paths, _ = both
    assert main(["verify", str(paths[kind])]) == 0
    out = capsys.readouterr().out
    assert ": intact: 3 items" in out and "BAD" not in out


def test_verify_flipped_data_byte_names_the_item_and_exits_1(both, capsys):
    paths, _ = both
    flip(data_file(paths["fp"]), 10)  # inside the first item, model.w
    assert main(["verify", str(paths["fp"])]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and "model.w" in bad[0] and data_file(paths["fp"]).name in bad[0]
    assert "DAMAGED (1 problem)" in out


def test_verify_flipped_metadata_byte_exits_1(both, capsys):
    paths, _ = both
    flip(paths["fp"] / ".metadata", 20)
    assert main(["verify", str(paths["fp"]), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and any(".metadata" in p for p in report["problems"])


def test_verify_missing_checkpoint_exits_1_with_one_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fp-dcp verify: error: ") and len(err.strip().splitlines()) == 1


def test_inspect_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "model.pt")]) == 1
    assert "model.pt is not a directory, so not a checkpoint" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "empty")]) == 1
    assert ".metadata is missing" in capsys.readouterr().err


def test_verify_progress_bar_on_request(both, capsys):
    paths, _ = both
    assert main(["verify", str(paths["fp"]), "--progress"]) == 0
    err = capsys.readouterr().err
    total = sum(p.stat().st_size for p in paths["fp"].iterdir() if p.suffix == ".distcp")
    assert f"verify [{'#' * 24}] {total}/{total} B, " in err


@pytest.mark.parametrize(("kind", "to"), [("fp", "dcp"), ("dcp", "fp"), ("fp", "torch"), ("dcp", "safetensors")])
def test_convert_both_kinds(both, tmp_path, kind, to, capsys):
    pytest.importorskip("safetensors", reason="safetensors is in the test extra")
    paths, s = both
    dst = tmp_path / f"out-{to}"
    argv = ["convert", str(paths[kind]), str(dst), "--to", to]
    if to == "safetensors":
        assert main(argv) == 1
        assert "--drop-non-tensors" in capsys.readouterr().err
        argv.append("--drop-non-tensors")
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"({kind}) to {dst} ({to}): 2 tensors" in captured.out
    if to == "safetensors":
        assert "left out extra.step" in captured.err  # the left-out entry is named
        from safetensors.torch import load_file

        assert torch.equal(load_file(dst / "model-00001-of-00001.safetensors")["model.w"], s["model"]["w"])
        assert main(["verify", str(dst)]) == 0
    elif to == "torch":
        assert torch.equal(torch.load(dst)["model"]["w"], s["model"]["w"])
    else:
        assert main(["verify", str(dst)]) == 0


def test_convert_to_safetensors_shards_and_one_file(both, tmp_path, capsys):
    pytest.importorskip("safetensors", reason="safetensors is in the test extra")
    from safetensors.torch import load_file

    paths, s = both
    shards, one = tmp_path / "hf", tmp_path / "model.safetensors"
    argv = ["convert", str(paths["fp"]), "--to", "safetensors", "--drop-non-tensors"]
    assert main([*argv[:2], str(shards), *argv[2:], "--max-shard-size", "1KB"]) == 0
    files = sorted(p.name for p in shards.iterdir())
    assert files == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)] + ["model.safetensors.index.json"]
    assert main([*argv[:2], str(one), *argv[2:]]) == 0  # a .safetensors name: one file, as before
    assert torch.equal(load_file(one)["model.w"], s["model"]["w"])
    capsys.readouterr()
    assert main([*argv[:2], str(tmp_path / "x"), *argv[2:], "--max-shard-size", "lots"]) == 1
    assert "'lots' is not a size" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_convert_refuses_existing_destination_without_force(both, tmp_path, capsys):
    paths, _ = both
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"keep me")
    assert main(["convert", str(paths["fp"]), str(dst), "--to", "torch"]) == 1
    assert "--force" in capsys.readouterr().err and dst.read_bytes() == b"keep me"
    assert main(["convert", str(paths["fp"]), str(dst), "--to", "torch", "--force"]) == 0
    assert dst.read_bytes() != b"keep me"


def test_verbose_shows_the_log(both, tmp_path, capsys):
    paths, _ = both
    assert main(["convert", str(paths["fp"]), str(tmp_path / "o.pt"), "--to", "torch", "-v"]) == 0
    err = capsys.readouterr().err
    assert "fp-dcp convert, reading " in err and re.search(r"[\d.]+ [KMG]?B/s", err)


HUGE = fio.Fio(huge_page=2 * MiB)


def fake_report(limit: fio.Fio | None = HUGE, tmpfs: str | None = None) -> dict:
    """``bench_report.report`` over made-up measurements: the real code path of the JSON, without minutes of I/O."""
    methods = bench.build_methods({}, 1, [1, 2], "unused", limit, tmpfs)
    for i, m in enumerate(methods):
        if m.save is None:  # a reference for loads only: run() never saves with it
            m.loaded["fresh"].gbps, m.loaded["fresh"].cpu_per_gb = [1.5 + i], [2.0]
            continue
        m.saved.gbps, m.saved.cpu_per_gb = [1.0 + i, 1.2 + i, 0.8 + i], [0.5]
        m.saved.in_flight, m.saved.request_kib = [8.0 + i], [4096.0]
        m.peak_rss = [1 << 20]
        for k, runs in enumerate(m.loaded.values()):
            runs.gbps, runs.cpu_per_gb = [2.0 + i + k], [0.1 + k]
            runs.in_flight, runs.request_kib = [20.0 + i], [1024.0 + i]
    return bench_report.report(methods, 10**9, os.getcwd(), limit)


def test_bench_plot_draws_the_medians(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra")
    report = fake_report()
    monkeypatch.setattr(bench, "run", lambda *args: report)
    png = tmp_path / "bench.png"
    assert main(["bench", "--repeats", "1", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in capsys.readouterr().out
    fig = plot.plot_bench(report, tmp_path / "again.png")
    save_bars, fresh_bars, touched_bars = fig.axes[0].containers
    rows = list(report["methods"].values())
    assert [b.get_height() for b in save_bars] == [row["save_gbps"] or 0.0 for row in rows]
    assert [b.get_height() for b in fresh_bars] == [plot.load_gbps(row, "fresh") for row in rows]
    assert [b.get_height() for b in touched_bars] == [plot.load_gbps(row, "touched") for row in rows]
    fp = report["methods"]["fp-dcp"]["loads"]
    assert fresh_bars[0].get_height() == fp["fresh"]["gbps"] and touched_bars[0].get_height() == fp["touched"]["gbps"]


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"fp-dcp\[plot\]"):
        plot.require_matplotlib()
    monkeypatch.setattr(bench, "run", lambda *args: pytest.fail("the benchmark ran before the plot was refused"))
    assert main(["bench", "--plot", "x.png"]) == 1
    assert "fp-dcp bench: error: plotting needs matplotlib: pip install 'fp-dcp[plot]'" in capsys.readouterr().err


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_in_place_on_a_terminal():
    stream = FakeTTY()
    bar = ProgressBar("read", stream, width=10)
    bar(0, 4_000_000_000)
    bar(4_000_000_000, 4_000_000_000)
    bar.close()
    text = stream.getvalue()
    assert text.startswith("\rread [##########] 4.00/4.00 GB, ") and text.endswith("\n")
    assert "GB/s" in text


def test_progress_bar_writes_lines_into_a_log():
    stream = io.StringIO()
    bar = ProgressBar("verify", stream, width=4)
    bar(0, 2000)
    bar(1000, 2000)  # within the interval: not drawn
    bar(2000, 2000)
    bar.close()
    (line,) = stream.getvalue().splitlines()  # no carriage returns, one line per draw
    assert line.startswith("verify [####] 2000/2000 B, ")


def test_progress_text_units_rate_and_eta():
    assert progress_text(2_000_000_000, 4_000_000_000, 2.0) == "2.00/4.00 GB, 1.00 GB/s, ETA 2 s"
    assert progress_text(3_000_000, 3_000_000, 1.5) == "3.00/3.00 MB, 2.00 MB/s, 1.5 s"
    assert progress_text(0, 500, 0.0) == "0/500 B, 0.00 B/s, 0.0 s"


def test_human_sizes():
    sizes = (0, 1023, 1024, 1536 * 1024, 3 << 30, 5 << 40)
    assert [human(n) for n in sizes] == ["0 B", "1023 B", "1.0 KiB", "1.5 MiB", "3.0 GiB", "5120.0 GiB"]


@pytest.mark.parametrize("limit", [HUGE, fio.Fio(why_plain="cannot reserve huge pages"), None])
def test_bench_measures_against_fio_when_it_is_installed(limit, capsys):
    r = fake_report(limit)
    methods = r["methods"]
    if limit is not None:
        name = "fio depth 32, " + ("huge pages" if limit.huge_page else "4 KiB pages")
        assert r["fio"] == {"method": name, "buffers": limit.buffers, "huge_pages": bool(limit.huge_page)}
        fp, fio_row = methods["fp-dcp"], methods[name]
        assert r["ratios"]["save_vs_fio"] == pytest.approx(fp["save_gbps"] / fio_row["save_gbps"])
        for kind in ("fresh", "touched"):  # each kind of target against fio's read
            expected = fp["loads"][kind]["gbps"] / fio_row["loads"]["disk"]["gbps"]
            assert r["ratios"][f"load_{kind}_vs_fio"] == pytest.approx(expected)
            assert f"load ({kind} targets) >= 0.95 x fio" in r["bars"]
        assert "save >= 1.0 x fio" in r["bars"]
    else:
        assert r["fio"] is None and not any(name.startswith("fio") for name in methods)
        assert r["ratios"]["save_vs_fio"] is None and "save >= 0.85 x dd" in r["bars"]
    assert (
        r["bars"]["load (fresh targets) CPU-s/GB <= 0.15"] and not r["bars"]["load (touched targets) CPU-s/GB <= 0.15"]
    )
    bench_report.print_report(r, 3)
    out = capsys.readouterr().out
    if limit is None:
        assert "fio is not installed: dd is the only reference for the disk (apt-get install fio)" in out
    elif limit.huge_page:
        assert "x into touched ones (fio from huge-page buffers: the disk's limit)" in out
    else:  # the fio line says why its buffers are not in huge pages
        assert "(fio from plain buffers (cannot reserve huge pages): below the disk's limit" in out


def test_bench_loads_into_fresh_and_touched_targets_and_saves_into_the_null_sink():
    methods = {m.name: m for m in bench.build_methods({}, 1, [1, 2], "unused", HUGE)}
    assert set(methods["fp-dcp"].loads) == {"fresh", "touched"}
    assert set(methods["FileSystemWriter t=1"].loads) == {"fresh", "touched"}  # the stock reader too
    assert not methods["FileSystemWriter t=2"].loads and not methods[bench.NULL].loads
    assert set(methods["fio depth 32, huge pages"].loads) == {"disk"}


def test_bench_times_the_first_touch_of_fresh_memory_beside_the_fresh_load(tmp_path, monkeypatch, capsys):
    """The memory's own limit for fresh targets: faulted in right after fp-dcp's fresh load, before its check."""
    steps = []
    size = 4 * MiB

    class Spy(bench.Prefaulter):
        def prepare(self, memory):
            steps.append(("first touch", memory.nbytes, self.threads))
            return super().prepare(memory)

    monkeypatch.setattr(bench, "Prefaulter", Spy)
    sd = {"w": torch.arange(size // 4, dtype=torch.float32)}
    methods = bench.build_methods(sd, size, [1], str(tmp_path), None)
    fp = methods[0]
    memory = fp.beside["fresh"]
    assert memory.name == bench.MEMORY and memory.save is None and set(memory.loads) == {"fresh"}
    for kind, step in list(fp.loads.items()):
        fp.loads[kind] = lambda path, step=step, kind=kind: (steps.append(("load", kind)), step(path))[1]
    check = fp.check
    fp.check = lambda: (steps.append(("check",)), check())[1]
    monkeypatch.setattr(bench, "llm_state_dict", lambda nbytes: sd)
    monkeypatch.setattr(bench, "build_methods", lambda *args: [fp, memory])
    monkeypatch.setattr(bench, "report", lambda methods, *args: methods)
    bench.run(size / bench.GB, str(tmp_path), 1, [1])
    threads = bench.IOConfig().threads()
    assert steps == [("load", "fresh"), ("first touch", size, threads), ("check",), ("load", "touched"), ("check",)]
    assert len(memory.loaded["fresh"].gbps) == 1 and not memory.saved.gbps  # timed once, never saved


def test_bench_compares_fresh_loads_with_the_slower_of_the_disk_and_the_first_touch(capsys):
    r = fake_report()
    methods, q = r["methods"], r["ratios"]
    fp = methods["fp-dcp"]["loads"]["fresh"]["gbps"]
    touch = methods[bench.MEMORY]["loads"]["fresh"]["gbps"]
    disk = methods["fio depth 32, huge pages"]["loads"]["disk"]["gbps"]
    assert methods[bench.MEMORY]["save_gbps"] is None and methods[bench.MEMORY]["peak_rss_growth_mib"] is None
    assert q["load_fresh_vs_first_touch"] == pytest.approx(fp / touch)
    assert q["load_fresh_vs_slower_limit"] == pytest.approx(fp / min(touch, disk))
    assert r["bars"]["load (fresh targets) >= 0.95 x min(fio, first touch)"] == (fp / min(touch, disk) >= 0.95)
    bench_report.print_report(r, 3)
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith(bench.MEMORY) and "fresh" not in line for line in lines)  # no save row
    assert any(line.startswith(bench.MEMORY) and line.split()[-5] == "fresh" for line in lines)
    assert any(line.startswith(f"fresh memory faults in at {touch:.2f} GB/s here") for line in lines)


def test_bench_prints_the_disks_requests_for_saves_and_loads(capsys):
    r = fake_report()
    fp = r["methods"]["fp-dcp"]
    assert (fp["save_in_flight"], fp["save_request_kib"]) == (8, 4096)
    assert (fp["loads"]["fresh"]["in_flight"], fp["loads"]["touched"]["request_kib"]) == (20, 1024)
    assert r["methods"]["dd oflag=direct"]["loads"] == {}  # no load: no read figures
    bench_report.print_report(r, 3)
    lines = capsys.readouterr().out.splitlines()
    save_header = next(line for line in lines if line.startswith("save "))
    load_header = next(line for line in lines if line.startswith("load (cold)"))
    assert save_header.split()[-4:] == ["wr", "depth", "wr", "KiB"]
    assert load_header.split()[-4:] == ["rd", "depth", "rd", "KiB"]

    def rows(name: str) -> list[list[str]]:
        return [line[28:].split() for line in lines if line.startswith(name.ljust(28))]

    save_row, fresh_row, touched_row = rows("fp-dcp")
    assert save_row[-2:] == ["8.0", "4096"]
    assert fresh_row[0] == "fresh" and fresh_row[-2:] == ["20.0", "1024"]
    assert touched_row[0] == "touched"
    assert rows("fio depth 32, huge pages")[1][0] == "disk"
    assert rows("dd oflag=direct") == [rows("dd oflag=direct")[0]]  # a save, no load


def test_bench_watches_the_disk_over_a_step(monkeypatch):
    snapshots = iter(
        [DiskCounters(10, 800, 100, 0, 1000), DiskCounters(10, 800, 110, 8192, 4000)]  # 10 reads of 4 MiB in all
    )
    monkeypatch.setattr(bench.DiskCounters, "read", classmethod(lambda cls, disk: next(snapshots)))
    depth, kib, ran = [], [], []
    seconds = bench._watched("vda", ran.append, "/ckpt", depth, kib, reads=True)
    assert ran == ["/ckpt"] and kib == [409.6]
    assert depth == [pytest.approx(3.0 / seconds)]  # 3000 request-milliseconds over the step


def test_diskstats_tells_reads_from_writes():
    before = DiskCounters(writes=5, sectors_written=1000, reads=2, sectors_read=16, weighted_ms=0)
    after = DiskCounters(writes=15, sectors_written=9192, reads=6, sectors_read=2064, weighted_ms=6000)
    assert after.since(before, 2.0) == (3.0, 8192 * 512 / 10 / 1024)
    assert after.since(before, 2.0, reads=True) == (3.0, 2048 * 512 / 4 / 1024)
    assert before.since(before, 1.0, reads=True) == (0.0, 0.0)  # no requests: no size


def test_ls_lists_the_steps_of_a_run_and_exits_1_for_a_corrupt_one(tmp_path, capsys):
    from fp_dcp import CheckpointManager

    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=3) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((100,), float(step))})
    (root / "step-4").mkdir()  # a save that died before publishing
    flip(root / "step-2" / ".metadata", 20)
    assert main(["ls", str(root)]) == 1
    lines = capsys.readouterr().out.splitlines()
    status = {int(line.split()[0]): line.split()[1] for line in lines[1:-1]}
    assert status == {1: "complete", 2: "corrupt", 3: "complete", 4: "incomplete"}
    flip(data_file(root / "step-3"), 10)
    assert main(["ls", str(root), "--verify", "--json"]) == 1
    listed = {s["step"]: s for s in json.loads(capsys.readouterr().out)}
    assert listed[1]["status"] == "verified" and listed[3]["status"] == "corrupt"
    assert "checksum mismatch for 'w'" in listed[3]["problem"]


def test_ls_names_leftover_files_and_clean_removes_them_not_while_a_save_runs(tmp_path, capsys, monkeypatch):
    """An overwrite whose removal of the replaced files a crash cut short leaves them beside a whole checkpoint."""
    from fp_dcp.save import commit

    root = tmp_path / "run"
    step = root / "step-1"
    save({"w": torch.full((100,), 1.0)}, step).close()
    (old,) = [p.name for p in step.iterdir() if p.suffix == ".distcp"]
    monkeypatch.setattr(commit.Cleanup, "start", lambda self, directories, names: None)  # died after publishing
    save({"w": torch.full((100,), 2.0)}, step).close()
    monkeypatch.undo()
    (step / "notes.txt").write_text("mine")  # not fp-dcp's: never a leftover
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"+ 1 leftover file no checkpoint lists: {old}" in out and "--clean removes them" in out
    lock = commit.SaveLock(str(step))  # a save in progress: its files are not leftovers
    assert main(["ls", str(root), "--clean"]) == 1
    assert "another save to" in capsys.readouterr().err and (step / old).exists()
    lock.release()
    assert main(["ls", str(root), "--clean", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["status"] == "complete" and listed["leftovers"] == []
    assert not (step / old).exists() and (step / "notes.txt").read_text() == "mine"
    target = {"w": torch.zeros(100)}
    load(target, step)
    assert torch.equal(target["w"], torch.full((100,), 2.0))


# ---- fio, the disk's reference: huge pages reserved, and given back whatever happens


@pytest.fixture
def hugepage_knobs(tmp_path, monkeypatch):
    """``nr_hugepages`` and ``/proc/meminfo`` as files of the test's: 0 pages reserved, none free."""
    knob, meminfo = tmp_path / "nr_hugepages", tmp_path / "meminfo"
    knob.write_text("0\n")
    meminfo.write_text("MemTotal: 1000 kB\nHugePages_Free:        0\nHugepagesize:       2048 kB\n")
    monkeypatch.setattr(fio, "NR_HUGEPAGES", str(knob))
    monkeypatch.setattr(fio, "MEMINFO", str(meminfo))
    return knob, meminfo


def test_huge_pages_already_free_are_used_as_they_are(hugepage_knobs):
    knob, meminfo = hugepage_knobs
    meminfo.write_text(meminfo.read_text().replace("HugePages_Free:        0", "HugePages_Free:      200"))
    with fio.huge_pages(64 * MiB) as (page, why):
        assert (page, why) == (2 * MiB, "") and knob.read_text() == "0\n"


def test_huge_pages_reserved_are_given_back_also_on_interrupt(hugepage_knobs):
    knob, _ = hugepage_knobs
    with pytest.raises(KeyboardInterrupt):
        with fio.huge_pages(64 * MiB) as (page, why):
            assert knob.read_text() == "34\n"  # 32 pages and fio's spare ones
            # the fake kernel reserved none of them
            assert page is None and why == "the kernel found 0 of the 34 huge pages asked for: memory too fragmented"
            raise KeyboardInterrupt
    assert knob.read_text() == "0\n"


HOLD_HUGE_PAGES = """
import signal, subprocess, sys
# Ctrl-C as in a terminal's foreground job, whatever this test inherited (a shell's background job ignores SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)
from fp_dcp.tools import fio
if sys.argv[1] != "real":
    fio.NR_HUGEPAGES, fio.MEMINFO = sys.argv[1], sys.argv[2]
with fio.huge_pages(8 * 2**20) as (page, why):
    fio_run = subprocess.Popen(["sleep", "600"])  # fio's place: a child the signal may reach too
    try:
        print("reserved", flush=True)
        fio_run.wait()
    finally:  # as subprocess.run does
        fio_run.kill()
        fio_run.wait()
"""


@pytest.mark.slow
@pytest.mark.parametrize("knobs", ["fake", "real"])
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_huge_pages_are_given_back_when_a_signal_ends_the_process(hugepage_knobs, knobs, how):
    """A real process holding reserved huge pages, ended by a real signal: nr_hugepages is back as it was."""
    fake = knobs == "fake"
    knob = Path(fio.NR_HUGEPAGES) if fake else Path("/proc/sys/vm/nr_hugepages")
    if not fake and (os.geteuid() != 0 or not knob.exists()):
        pytest.skip("changing the kernel's nr_hugepages needs root")
    before = knob.read_text()
    args = [fio.NR_HUGEPAGES, fio.MEMINFO] if fake else ["real"]
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_HUGE_PAGES, *args],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "reserved\n"
        raised = knob.read_text()
        if knobs == "real" and raised == before:
            pytest.skip("the kernel had the huge pages free already: nothing was reserved")
        assert int(raised) > int(before)
        if how == "SIGTERM":
            os.kill(child.pid, signal.SIGTERM)  # kill PID: the process alone
        else:
            os.killpg(child.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group, fio's place included
        status = child.wait(timeout=120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        if knob.read_text() != before:  # the test must leave the machine as it found it, whatever happened
            knob.write_text(before)
            pytest.fail(f"nr_hugepages was left at the child's value; put back to {before.strip()}")
    assert status == (128 + signal.SIGTERM if how == "SIGTERM" else -signal.SIGINT)


def test_huge_pages_refused_say_why(hugepage_knobs, monkeypatch):
    knob, _ = hugepage_knobs

    def refusing_open(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise PermissionError(13, "Permission denied", path)
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(fio, "open", refusing_open, raising=False)
    with fio.huge_pages(8 * MiB) as (page, why):
        assert page is None
        assert why.startswith(f"cannot reserve huge pages in {knob}") and why.endswith(": Permission denied")
    assert knob.read_text() == "0\n"


def test_no_huge_pages_in_the_kernel(hugepage_knobs):
    _, meminfo = hugepage_knobs
    meminfo.write_text("MemTotal: 1000 kB\n")
    with fio.huge_pages(8 * MiB) as got:
        assert got == (None, "this kernel has no huge pages")


def test_fio_missing_is_said_not_an_error(monkeypatch):
    monkeypatch.setattr(fio.shutil, "which", lambda name: None)
    assert not fio.installed()
    with fio.reference() as runner:
        assert runner is None


def test_fio_command_lines():
    plain = fio.Fio(depth=4, block=MiB, why_plain="not root").args("/d/f", "write", 8 * MiB)
    assert "--iomem=shmhuge" not in " ".join(plain) and "--end_fsync=1" in plain
    assert {"--rw=write", "--size=8388608", "--bs=1048576", "--iodepth=4", "--direct=1"} <= set(plain)
    huge = fio.Fio(huge_page=2 * MiB).args("/d/f", "read", 8 * MiB, runtime_s=1.5)
    assert {"--iomem=shmhuge", f"--hugepage-size={2 * MiB}", "--runtime=1500ms", "--rw=read"} <= set(huge)
    assert "--end_fsync=1" not in huge
    assert fio.Fio(why_plain="not root").buffers == "plain buffers (not root)"
    assert fio.Fio(huge_page=2 * MiB).label == "fio depth 32, huge pages"


@pytest.mark.skipif(not fio.installed(), reason="fio is not installed (make installs it)")
def test_fio_runs_from_huge_pages_where_it_can_and_gives_them_back(tmp_path):
    knob = fio.NR_HUGEPAGES
    before = open(knob).read() if os.path.exists(knob) else None
    with fio.reference(depth=2, block=MiB) as runner:
        assert runner is not None and (runner.huge_page is not None or runner.why_plain)
        wrote = runner.run(str(tmp_path / "f"), "write", 4 * MiB)
        read = runner.run(str(tmp_path / "f"), "read", 4 * MiB)
        with pytest.raises(RuntimeError, match=r"fio read of .*f/x failed: .*Not a directory"):
            runner.run(str(tmp_path / "f" / "x"), "read", MiB)  # under a regular file
    assert wrote.bytes == read.bytes == 4 * MiB and wrote.gbps > 0 and read.gbps > 0
    assert (open(knob).read() if before is not None else None) == before


def test_bench_saves_into_tmpfs_and_loads_back_against_fio_there(capsys):
    r = fake_report(tmpfs="/memory")
    jobs = fio.Jobs(jobs=bench.IOConfig().threads())
    name = bench.tmpfs_fio_name(jobs.jobs)
    methods, q = r["methods"], r["ratios"]
    assert set(methods[bench.TMPFS]["loads"]) == {"fresh", "touched"} and set(methods[name]["loads"]) == {"disk"}
    assert q["tmpfs_save_vs_fio"] == pytest.approx(methods[bench.TMPFS]["save_gbps"] / methods[name]["save_gbps"])
    fio_load = methods[name]["loads"]["disk"]["gbps"]
    for kind in ("fresh", "touched"):
        assert q[f"tmpfs_load_{kind}_vs_fio"] == pytest.approx(methods[bench.TMPFS]["loads"][kind]["gbps"] / fio_load)
    first_touch = methods[bench.MEMORY]["loads"]["fresh"]["gbps"]
    slower = methods[bench.TMPFS]["loads"]["fresh"]["gbps"] / min(first_touch, fio_load)
    assert q["tmpfs_load_fresh_vs_slower_limit"] == pytest.approx(slower)
    assert r["bars"][f"tmpfs save >= 0.9 x {name}"] == (q["tmpfs_save_vs_fio"] >= 0.9)
    assert r["bars"][f"tmpfs load (fresh targets) >= 0.9 x min({name}, first touch)"] == (slower >= 0.9)
    bench_report.print_report(r, 3)
    out = capsys.readouterr().out
    assert (
        f"into tmpfs (memory; each writer after the pages were recycled): save = {q['tmpfs_save_vs_fio']:.2f} x" in out
    )
    assert f"into fresh ones = {q['tmpfs_load_fresh_vs_fio']:.2f} x fio, {slower:.2f} x the slower of it and" in out
    assert "tmpfs_save_vs_fio" not in fake_report()["ratios"]  # no tmpfs given: no rows


def test_bench_tmpfs_rows_run_in_the_memory_directory_recycled_first_and_bit_exact(tmp_path, monkeypatch):
    size = 4 * MiB
    sd = {"w": torch.arange(size // 4, dtype=torch.float32)}
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    memory.mkdir()
    disk.mkdir()
    build, seen = bench.build_methods, []
    recycle = bench.recycle
    monkeypatch.setattr(bench, "recycle", lambda path, nbytes: (seen.append(os.listdir(path)), recycle(path, nbytes)))

    def tmpfs_only(*args):
        return [m for m in build(*args) if m.name == bench.TMPFS]

    monkeypatch.setattr(bench, "llm_state_dict", lambda nbytes: sd)
    monkeypatch.setattr(bench, "build_methods", tmpfs_only)
    monkeypatch.setattr(bench, "report", lambda methods, *args: methods)
    (m,) = bench.run(size / bench.GB, str(disk), 2, [1], str(memory))
    assert seen == [[], []]  # recycled before each save, into the empty directory it then saves into
    assert len(m.saved.gbps) == 2  # the check ran after each load: bit-exact
    assert len(m.loaded["fresh"].gbps) == len(m.loaded["touched"].gbps) == 2
    assert os.listdir(memory) == [] and os.listdir(disk) == []


def test_bench_times_a_step_by_the_seconds_it_returns_else_by_the_call():
    assert bench._watched(None, lambda path: 2.5, "x", [], []) == 2.5  # fio's own clock
    assert bench._watched(None, lambda path: {"loaded": 1}, "x", [], []) < 1  # what torch.load returns: the call


def test_bench_takes_a_tmpfs_with_room_for_the_state_only(tmp_path, capsys):
    here = str(tmp_path)
    tmpfs = filesystem_of(here) == "tmpfs"
    assert bench.memory_directory(1, here) == (here if tmpfs else None)
    if not tmpfs:
        assert f"no tmpfs row ({here} is not a tmpfs)" in capsys.readouterr().err
    if filesystem_of("/dev/shm") == "tmpfs":
        assert bench.memory_directory(1 << 60) is None
        assert "no tmpfs row (/dev/shm has less room than 2.5 x the state)" in capsys.readouterr().err
