"""PNG figures of an `analyze` report, after Row-Meets-Experts's Figures 12 and 14. Reads only the report dict,
so a saved `--json` report can be plotted again."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def skew_figure(kind: dict, path: Path) -> None:
    """Figure 12: picks per expert over the trace in one layer; picks per device in one step."""
    ex = kind["example"]
    experts = np.asarray(ex["expert_picks"])
    devices = np.asarray(ex["device_picks"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    left.bar(np.arange(len(experts)), experts, width=1.0, color="tab:blue")
    left.axhline(experts.mean(), color="black", linestyle="--", label=f"mean {experts.mean():.0f}")
    left.set(
        title=f"Picks per expert in layer {kind['per_layer']['layer'][ex['layer']]} over {kind['steps']} steps\n"
        f"busiest {experts.max() / experts.mean():.1f}x the mean",
        xlabel="expert id",
        ylabel="picks",
        xlim=(-0.5, len(experts) - 0.5),
    )
    left.legend()
    right.bar(np.arange(len(devices)), devices, color="tab:orange")
    right.axhline(devices.mean(), color="black", linestyle="--", label=f"mean {devices.mean():.0f}")
    right.set(
        title=f"Picks per device in step {ex['step']}\nbalancedness {devices.mean() / devices.max():.2f}",
        xlabel=f"device (of {ex['n']}, contiguous experts)",
        ylabel="picks",
    )
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scaling_figure(kind: dict, path: Path) -> None:
    """Figure 14: copies per row and balancedness against the number of devices."""
    entries = kind["devices"]
    n = [d["n"] for d in entries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(n, [x - 1 for x in n], "o-", color="black", label="row on every device (N - 1)")
    left.plot(
        n, [d["contiguous"]["copies_per_row"] for d in entries], "o-", color="tab:blue", label="traveling rows, trace"
    )
    left.plot(
        n, [d["even"]["copies_per_row"] for d in entries], "x--", color="tab:gray", label="traveling rows, even router"
    )
    left.set(title="Copies sent per row", xlabel="devices", ylabel="copies", xticks=n)
    left.legend()
    right.plot(
        n, [d["contiguous"]["balancedness"] for d in entries], "o-", color="tab:blue", label="contiguous experts"
    )
    if "eplb_test" in entries[0]:
        right.plot(
            n,
            [d["eplb_test"]["balancedness"] for d in entries],
            "o-",
            color="tab:green",
            label=f"EPLB (fitted on {kind['fit_steps']} steps, scored on {kind['test_steps']})",
        )
    right.plot(n, [d["even"]["balancedness"] for d in entries], "x--", color="tab:gray", label="even router")
    right.set(
        title="Balancedness (mean / busiest device's picks)",
        xlabel="devices",
        ylabel="balancedness",
        xticks=n,
        ylim=(0, 1),
    )
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(report: dict, directory: str | Path) -> list[Path]:
    """Both figures for every step kind in the report; returns the files written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, kind in report["kinds"].items():
        for stem, draw in (("skew", skew_figure), ("scaling", scaling_figure)):
            path = directory / f"{name}_{stem}.png"
            draw(kind, path)
            written.append(path)
    return written


def step_trace_heatmap(doc: dict, path: str | Path) -> Path:
    """Decode-Anatomy's picture of a `moejax trace` report: expert time per device (rows) and MoE layer
    (columns), each layer's slowest device outlined."""
    layers = doc["layers"]
    grid = np.array([[d["experts_ms"] for d in entry["devices"]] for entry in layers]).T  # [devices, layers]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 + 0.5 * len(layers)), max(3.5, 1.3 + 0.35 * grid.shape[0])))
    image = ax.imshow(grid, aspect="auto", cmap="viridis", origin="upper")
    for i, entry in enumerate(layers):
        ax.add_patch(plt.Rectangle((i - 0.5, entry["slowest_device"] - 0.5), 1, 1, fill=False, color="red", lw=2))
    ax.set(
        xticks=range(len(layers)),
        xticklabels=[e["layer"] for e in layers],
        yticks=range(grid.shape[0]),
        xlabel="MoE layer",
        ylabel="device",
        title=f"{doc['placement']}: expert time per device (ms)\nstep {doc['step_ms']:.2f} ms; "
        f"sum of slowest - mean {doc['imbalance_ms']:.2f} ms",
    )
    fig.colorbar(image, ax=ax, label="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
