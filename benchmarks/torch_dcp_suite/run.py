"""Run PyTorch's DCP tests twice, on stock torch and with fp-dcp's storage in its place, and compare.

    python benchmarks/torch_dcp_suite/run.py --tests ~/pytorch/test/distributed/checkpoint \\
        test_file_system_checkpoint_cpu.py test_save_load_api.py

Each test file runs under pytest once as it is ("baseline") and once with
``FP_DCP_TORCH_SUITE_SHIM=1`` and ``site/`` on ``PYTHONPATH`` ("shim"; see
``shim.py``), one file at a time, each run in its own process group with a
time limit. Per-test outcomes come from pytest's ``--junitxml``; the table
gives per file the baseline and shim counts, then the tests that pass on
stock torch but not with the shim, with the first line of their error. The
JUnit files and pytest's output stay in ``--out`` for the full tracebacks;
a mode left out of ``--modes`` is reported from its last results there.
``--gpu-tests-on-cpu`` lets GPU-gated tests run on CPU in both modes (see
``site/sitecustomize.py``). Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
SITE = HERE / "site"
ENV = "FP_DCP_TORCH_SUITE_SHIM"
GPU_TESTS_ON_CPU_ENV = "FP_DCP_TORCH_SUITE_GPU_TESTS_ON_CPU"
MODES = ("baseline", "shim")
OUTCOMES = ("passed", "failed", "skipped", "error")


@dataclasses.dataclass
class FileRun:
    """One pytest run of one test file in one mode."""

    file: str
    mode: str
    seconds: float
    returncode: int | None  # None: killed at the time limit
    outcomes: dict[str, str]  # test id -> passed / failed / skipped / error
    messages: dict[str, str]  # test id -> first line of its failure or error

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)


def test_files(tests: Path, names: list[str]) -> list[str]:
    """The files to run: ``names`` as given, else every ``test_*.py`` in ``tests`` and ``tests/e2e``."""
    if names:
        return names
    found = sorted(p.relative_to(tests).as_posix() for p in tests.glob("test_*.py"))
    found += sorted(p.relative_to(tests).as_posix() for p in tests.glob("e2e/test_*.py"))
    return found


def environment(mode: str, gpu_tests_on_cpu: bool = False) -> dict[str, str]:
    """The environment of a run: the shim's site directory on the path in both modes, switched on in one."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH", "")]))
    env[ENV] = "1" if mode == "shim" else "0"
    env[GPU_TESTS_ON_CPU_ENV] = "1" if gpu_tests_on_cpu else "0"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_shim(python: str) -> None:
    """Fail fast when the shim does not load (fp-dcp or torch missing from ``python``)."""
    probe = "import torch.distributed.checkpoint as d; print(d.FileSystemWriter.__module__)"
    out = subprocess.run(
        [python, "-c", probe], env=environment("shim"), capture_output=True, text=True, check=False, timeout=300
    )
    if out.returncode != 0 or not out.stdout.strip().startswith("fp_dcp"):
        sys.exit(f"the shim did not load under {python}:\n{out.stdout}{out.stderr}")


def parse_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Per-test outcomes and first error lines from a pytest JUnit XML file (empty when there is none)."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    if not path.exists():
        return outcomes, messages
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = child.get("message") or child.text or ""
                messages[test] = text.strip().splitlines()[0][:200] if text.strip() else ""
                break
        # pytest reports an error in teardown as a second entry for a test that passed
        if outcomes.get(test) in ("failed", "error") and outcome == "passed":
            continue
        outcomes[test] = outcome
    return outcomes, messages


def run_file(
    python: str, tests: Path, name: str, mode: str, out: Path, timeout: float, extra: list[str], gpu_tests_on_cpu: bool
) -> FileRun:
    """Run one test file under pytest in one mode; kill its process group at ``timeout`` seconds."""
    stem = name.replace("/", "__").removesuffix(".py")
    junit = out / mode / f"{stem}.xml"
    log = out / mode / f"{stem}.log"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    command = [python, "-m", "pytest", name, "-p", "no:cacheprovider", "-rA", f"--junitxml={junit}", *extra]
    start = time.monotonic()
    with open(log, "w") as output:
        process = subprocess.Popen(
            command,
            cwd=tests,
            env=environment(mode, gpu_tests_on_cpu),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
            output.write(f"\n[run.py] killed after {timeout:.0f} s\n")
    outcomes, messages = parse_junit(junit)
    return FileRun(name, mode, time.monotonic() - start, returncode, outcomes, messages)


def counts(run: FileRun) -> str:
    if run.returncode is None and not run.outcomes:
        return "TIMEOUT"
    text = "/".join(str(run.count(o)) for o in OUTCOMES)
    if run.returncode is None:
        text += " (timeout)"
    elif not run.outcomes:
        text += f" (rc {run.returncode})"
    return text


def report(runs: dict[str, dict[str, FileRun]]) -> str:
    """The table of counts per file, then the tests that pass on stock torch but not with the shim."""
    width = max([len(name) for name in runs] + [4])
    lines = [f"{'file':<{width}}  {'baseline p/f/s/e':<24}  {'shim p/f/s/e':<24}  seconds (b/s)"]
    regressions: list[str] = []
    for name, by_mode in runs.items():
        base, shim = by_mode["baseline"], by_mode["shim"]
        seconds = f"{base.seconds:.0f}/{shim.seconds:.0f}"
        lines.append(f"{name:<{width}}  {counts(base):<24}  {counts(shim):<24}  {seconds}")
        for test, outcome in base.outcomes.items():
            if outcome == "passed" and shim.outcomes.get(test) != "passed":
                got = shim.outcomes.get(test, "missing")
                regressions.append(f"  {name}::{test}  [{got}] {shim.messages.get(test, '')}")
    totals = {mode: {o: sum(r[mode].count(o) for r in runs.values()) for o in OUTCOMES} for mode in MODES}
    lines.append(
        f"{'total':<{width}}  "
        + "  ".join(f"{'/'.join(str(totals[m][o]) for o in OUTCOMES):<24}" for m in MODES).rstrip()
    )
    lines.append("")
    lines.append(f"pass on stock torch, not with the shim: {len(regressions)}")
    lines.extend(regressions)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=Path, required=True, help="pytorch's test/distributed/checkpoint")
    parser.add_argument("files", nargs="*", help="test files relative to --tests (default: all test_*.py)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per file per mode (default 600)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/fp_dcp_torch_suite"), help="JUnit files and logs")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with torch and fp-dcp")
    parser.add_argument("--modes", default="baseline,shim", help="comma-separated subset of baseline,shim")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, space-separated")
    parser.add_argument(
        "--gpu-tests-on-cpu",
        action="store_true",
        help="run tests marked skip_if_lt_x_gpu on CPU too, in both modes (see site/sitecustomize.py)",
    )
    args = parser.parse_args()

    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES):
        parser.error(f"--modes takes {','.join(MODES)}")
    tests = args.tests.resolve()
    out = args.out.resolve()
    if "shim" in modes:
        check_shim(args.python)
    runs: dict[str, dict[str, FileRun]] = {}
    start = time.monotonic()
    for name in test_files(tests, args.files):
        for mode in MODES:
            if mode in modes:
                extra = args.pytest_args.split()
                run = run_file(args.python, tests, name, mode, out, args.timeout, extra, args.gpu_tests_on_cpu)
                print(f"{name} [{mode}] {counts(run)} in {run.seconds:.0f} s", flush=True)
            else:  # a mode not run this time: reuse its last results, if any
                outcomes, messages = parse_junit(out / mode / f"{name.replace('/', '__').removesuffix('.py')}.xml")
                run = FileRun(name, mode, 0.0, 0, outcomes, messages)
            runs.setdefault(name, {})[mode] = run
    table = report(runs)
    print()
    print(table)
    print(f"\nwall time {time.monotonic() - start:.0f} s; logs and JUnit files in {out}")
    (out / "summary.txt").write_text(table + "\n")
    (out / "results.json").write_text(
        json.dumps({n: {m: dataclasses.asdict(r) for m, r in d.items()} for n, d in runs.items()}, indent=1)
    )


if __name__ == "__main__":
    main()
