"""The save pipeline with the device out of the way: a CPU state into the null sink, two checkouts alternating.

    python benchmarks/pipeline_bench.py --baseline ../other-checkout [--gb 2] [--rounds 3] [--dir DIR]

``IOConfig(engine="null")`` completes every write at once and stores nothing
(``fp_dcp.io.engine.NullEngine``), so what a save costs there is the
pipeline's own work: resolving, laying out, copying into the staging
buffers, checksumming, submitting. Each round saves the same Llama-shaped
state (``fp_dcp.tools.workload``) once with this checkout and once with the
``--baseline`` one (each built in place; a baseline older than the null
engine needs one added: the note that uses it says which), each in a process
of its own, alternating, and prints the GB/s of ``write_data`` (the
pipeline; ``SaveSummary.seconds``), of the whole ``dcp.save``, and the
CPU-seconds per GB, with the median ratio. Settings are each checkout's
defaults; ``--direct-writes`` forces the choice between copying through the
staging buffers (0) and writing from tensor memory (1) in both. Run it with
this checkout's fp-dcp importable (``PYTHONPATH=.``, or installed in place);
the checkouts' children run as ``fp_dcp.testing.checkouts`` says.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

# The child runs with each checkout's fp-dcp: what it uses must be in the baseline too (not fp_dcp.testing).


def child(gb: float, directory: str, direct_writes: str | None) -> None:
    """One save into the null sink with the fp_dcp found first on sys.path; prints a JSON line."""
    import torch.distributed.checkpoint as dcp

    from fp_dcp import FastPersistWriter, IOConfig

    try:
        from fp_dcp.tools.workload import llm_state_dict
    except ImportError:  # a checkout from before workload.py
        from fp_dcp.tools.bench import llm_state_dict  # type: ignore[attr-defined,no-redef]

    warnings.filterwarnings("ignore")
    sd = llm_state_dict(int(gb * 1e9))
    size = sum(v.nbytes for v in sd.values() if hasattr(v, "nbytes"))
    choice = {"0": False, "1": True}.get(direct_writes or "")
    writer = FastPersistWriter(directory, config=IOConfig(engine="null", direct_writes=choice))
    dcp.save(sd, storage_writer=writer, no_dist=True)  # warm: buffers, rings, first-touch of the state
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    dcp.save(sd, storage_writer=writer, no_dist=True)
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    assert writer.last_save is not None
    print(
        json.dumps(
            {
                "pipeline_gbps": size / writer.last_save.seconds / 1e9,
                "save_gbps": size / seconds / 1e9,
                "cpu_s_per_gb": (usage.ru_utime + usage.ru_stime - cpu) / (size / 1e9),
                "engine": writer.last_save.engine,
            }
        )
    )
    writer.close()


def run_checkout(name: str, checkout: Path, gb: float, directory: str, direct_writes: str | None) -> dict[str, float]:
    from fp_dcp.testing.checkouts import run_child

    argv = [__file__, "--child", "--gb", str(gb), "--dir", directory]
    if direct_writes is not None:
        argv += ["--direct-writes", direct_writes]
    result: dict[str, float] = run_child(name, checkout, argv, env={"FP_DCP_ENGINE": "null"})
    shutil.rmtree(directory, ignore_errors=True)  # a baseline may have published its (empty) checkpoint
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="another fp-dcp checkout, built in place")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the (empty) data files are created")
    ap.add_argument("--direct-writes", choices=["0", "1"], help="force IOConfig.direct_writes in both checkouts")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    directory = os.path.join(args.dir, "fp-dcp-pipeline-bench")
    if args.child:
        child(args.gb, directory, args.direct_writes)
        return 0
    from fp_dcp.testing.checkouts import checkouts as both

    checkouts = both(args.baseline)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for r in range(args.rounds):
        for name, checkout in checkouts.items():
            runs[name].append(run_checkout(name, checkout, args.gb, directory, args.direct_writes))
            last = runs[name][-1]
            print(f"  round {r + 1} {name:<14} pipeline {last['pipeline_gbps']:6.2f} GB/s", file=sys.stderr)
    med = statistics.median
    print(f"\nnull sink, {args.gb:g} GB Llama-shaped CPU state, median of {args.rounds} rounds, alternating")
    print(f"{'checkout':<16}{'write_data GB/s':>16}{'dcp.save GB/s':>15}{'CPU-s/GB':>10}")
    for name, results in runs.items():
        print(
            f"{name:<16}{med(x['pipeline_gbps'] for x in results):>16.2f}"
            f"{med(x['save_gbps'] for x in results):>15.2f}{med(x['cpu_s_per_gb'] for x in results):>10.3f}"
        )
    if "baseline" in runs:
        ratio = med(x["pipeline_gbps"] for x in runs["this checkout"]) / med(
            x["pipeline_gbps"] for x in runs["baseline"]
        )
        print(f"write_data: this checkout = {ratio:.2f} x the baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
