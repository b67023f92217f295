"""The straggler picture: a ranks x steps heat map of own compute time over the median band.

matplotlib is the optional ``report`` extra: it is imported inside ``render`` only, so the
daemon and every other command work without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurmft.errors import SlurmftError
from slurmft.report.steps import StepPicture

FLAG_COLOURS = {"straggler": "tab:red", "hang": "tab:orange"}
MISSING_COLOUR = "#d9d9d9"
DPI = 100


class PlottingUnavailable(SlurmftError):
    pass


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlottingUnavailable(
            "the picture needs matplotlib: pip install 'slurmft[report]' (or use --json)"
        ) from None
    matplotlib.use("Agg")  # files only; never a display on a login node
    import matplotlib.pyplot as plt

    return plt


def render(picture: StepPicture, out: Path, *, threshold: float | None = None) -> Any:
    """Write the PNG and return the matplotlib Figure (tests read the plotted data from it)."""
    plt = _pyplot()
    import numpy as np

    rows = len(picture.ranks)
    width = len(picture.columns)
    height_in = min(3 + 0.25 * rows, 30)
    fig, (heat, band) = plt.subplots(
        2,
        1,
        figsize=(12, height_in + 2.5),
        dpi=DPI,
        sharex=True,
        gridspec_kw={"height_ratios": [height_in, 2.5]},
    )
    data = np.ma.masked_invalid(np.array(picture.compute_s, dtype=float))
    # Steps a rank never finished (hung, gone, not started yet) are light grey holes.
    cmap = plt.get_cmap("viridis").with_extremes(bad=MISSING_COLOUR)
    image = heat.imshow(
        data,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        extent=(-0.5, width - 0.5, rows - 0.5, -0.5),
    )
    # One colour bar for both panels keeps their step axes the same width, aligned.
    fig.colorbar(image, ax=[heat, band], label="own compute time per step (s)", pad=0.01)
    heat.set_yticks(range(rows))
    heat.set_yticklabels(
        [_rank_label(rank, picture) for rank in picture.ranks], fontsize=max(4, 9 - rows // 16)
    )
    flagged = {rank: mark.kind for mark in picture.flags for rank in mark.ranks}
    for tick, rank in zip(heat.get_yticklabels(), picture.ranks, strict=True):
        if rank in flagged:
            tick.set_color(FLAG_COLOURS.get(flagged[rank], "tab:red"))
            tick.set_fontweight("bold")
    for mark in picture.flags:
        for rank in mark.ranks:
            if mark.column is not None and rank in picture.ranks:
                heat.plot(
                    mark.column,
                    picture.ranks.index(rank),
                    marker="x",
                    markersize=9,
                    color=FLAG_COLOURS.get(mark.kind, "tab:red"),
                )
    heat.set_title(f"run {picture.run_id}: own compute time per rank and step")

    x = np.arange(width)
    median = np.array([np.nan if v is None else v for v in picture.median_s])
    low = np.array([np.nan if v is None else v for v in picture.band_low_s])
    high = np.array([np.nan if v is None else v for v in picture.band_high_s])
    band.fill_between(x, low, high, color="tab:blue", alpha=0.25, label="25-75% of ranks")
    band.plot(x, median, color="tab:blue", label="median")
    if threshold is not None:
        band.plot(x, median * (1 + threshold), "--", color="grey", label="straggler threshold")
    for rank in sorted(flagged):
        row = np.array(
            [np.nan if v is None else v for v in picture.compute_s[picture.ranks.index(rank)]]
        )
        band.plot(x, row, color=FLAG_COLOURS.get(flagged[rank], "tab:red"), label=f"rank {rank}")
    band.set_ylabel("seconds")
    band.legend(loc="upper left", fontsize=7, ncols=4)

    for mark in picture.actions:
        if mark.column is None:
            continue
        for ax in (heat, band):
            ax.axvline(mark.column, color="white" if ax is heat else "black", lw=0.8, ls=":")
        heat.text(
            mark.column + 0.2,
            -0.45,
            mark.kind + (f" {mark.node}" if mark.node else ""),
            rotation=90,
            va="top",
            color="white",
            fontsize=7,
        )

    ticks = np.linspace(0, width - 1, num=min(width, 10)).round().astype(int)
    band.set_xticks(ticks)
    band.set_xticklabels([str(picture.columns[t][0]) for t in ticks])
    band.set_xlabel("step")
    fig.savefig(out, dpi=DPI)
    return fig


def _rank_label(rank: int, picture: StepPicture) -> str:
    node = picture.nodes.get(rank)
    slow = picture.slowdown.get(rank)
    label = f"rank {rank}" + (f" ({node})" if node else "")
    return label + (f" x{slow:.2f}" if slow is not None else "")
