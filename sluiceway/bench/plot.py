"""One PNG per benchmark: latency CDFs per configuration and output-throughput bars."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluiceway.bench.serve import BenchRun


@dataclass(slots=True)
class PlotSeries:
    """One configuration's curve and bar: latencies in ms, throughput in output tokens/s."""

    label: str
    e2e_ms: list[float]
    ttft_ms: list[float]
    output_throughput: float

    @classmethod
    def from_run(cls, label: str, run: BenchRun) -> PlotSeries:
        ok = [r for r in run.results if r.ok]
        return cls(
            label,
            [r.e2e * 1e3 for r in ok],
            [r.ttft * 1e3 for r in ok],
            run.figures["output_throughput"],
        )


def plot_runs(series: list[PlotSeries], path: str, title: str = "") -> None:
    """Writes a PNG to `path`: left, the empirical CDF of E2E latency (solid) and
    TTFT (dashed) per configuration, in seconds; right, output throughput bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=[3, 2])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(series):
        color = colors[i % len(colors)]
        for values, style, kind in ((s.e2e_ms, "-", "E2E"), (s.ttft_ms, "--", "TTFT")):
            if not values:
                continue
            x = np.sort(np.asarray(values)) / 1e3
            y = np.arange(1, len(x) + 1) / len(x)
            cdf.step(x, y, where="post", linestyle=style, color=color, label=f"{s.label} {kind}")
    cdf.set_xlabel("latency (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("Latency CDF (solid: E2E, dashed: TTFT)")
    cdf.grid(alpha=0.3)
    cdf.legend(fontsize=8)
    labels = [s.label for s in series]
    heights = [s.output_throughput for s in series]
    drawn = bars.bar(labels, heights, color=[colors[i % len(colors)] for i in range(len(series))])
    bars.bar_label(drawn, fmt="%.1f")
    bars.set_ylabel("output tokens/s")
    bars.set_title("Throughput")
    bars.tick_params(axis="x", labelrotation=15)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
