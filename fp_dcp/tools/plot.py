"""Bar charts of a benchmark's results (``fp-dcp bench --plot out.png``).

Needs matplotlib (``pip install 'fp-dcp[plot]'``), imported only when a plot
is drawn, so the rest of fp-dcp does not depend on it.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["plot_bench", "require_matplotlib"]


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or an ImportError that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'fp-dcp[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display needed, none used
    import matplotlib.pyplot as plt

    return plt


def load_gbps(row: dict[str, Any], kind: str) -> float:
    """A method's median load GB/s into ``kind`` targets; fio's read (the disk) stands for both kinds; 0 for none."""
    loads = row["loads"]
    load = loads.get(kind) or loads.get("disk")
    return float(load["gbps"]) if load else 0.0


def plot_bench(result: dict[str, Any], path: str | os.PathLike[str]) -> Any:
    """Draw the save and load GB/s of every method in ``result`` (``fp_dcp.tools.bench.run``'s) into a PNG at ``path``.

    Bars are medians (saves, loads into fresh and into touched targets); the black ticks are the individual
    save runs. Returns the matplotlib Figure (closed: it is not shown anywhere).
    """
    plt = require_matplotlib()
    methods = result["methods"]
    names = list(methods)
    x = range(len(names))
    width = 0.27
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4.2), layout="constrained")
    save = [methods[n]["save_gbps"] or 0.0 for n in names]  # None: a reference for loads only
    save_bars = ax.bar([i - width for i in x], save, width, label="save (median)", color="#3b6ea8")
    for i, name in enumerate(names):
        runs = methods[name]["runs_save_gbps"]
        ax.plot([i - width] * len(runs), runs, "_", color="black", markersize=12)
    ax.bar_label(save_bars, labels=[f"{v:.2f}" if v else "" for v in save], fontsize=8)
    for shift, kind, color in ((0.0, "fresh", "#e08a2c"), (width, "touched", "#f2c27b")):
        load = [load_gbps(methods[n], kind) for n in names]
        bars = ax.bar([i + shift for i in x], load, width, label=f"load into {kind} targets, cold", color=color)
        ax.bar_label(bars, labels=[f"{v:.2f}" if v else "" for v in load], fontsize=8)
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_ylabel("GB/s")
    engine = result["engine"]
    ax.set_title(
        f"{result['state_dict_bytes'] / 1e9:.1f} GB state dict, {result['directory_fs']}, {result['cpus']} CPUs, "
        f"fp-dcp engine {engine['engine']}{' + O_DIRECT' if engine.get('direct_io') else ''}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
    return fig
