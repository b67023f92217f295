"""The run's picture: its wall-clock timeline (world size, step rate, failures with the time
each cost shaded by cause, restarts, requeues, actions) above a ranks x steps heat map of own
compute time over the median band.

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
OVER_COLOUR = "#ff00ff"  # a cell above the colour scale (one huge step must not flatten it)
FAILURE_COLOUR = "#dc143c"  # used by nothing else in the timeline: tests find it in the pixels
CAUSE_COLOURS = {
    "detection": "#fdae61",
    "queue_wait": "#abd9e9",
    "restart": "#f46d43",
    "replay": "#fee090",
}
DPI = 100
# A cell more than this many times the median of all cells is off the scale (drawn OVER_COLOUR):
# one huge step leaves the others their colours, while a straggler (a rank 1.2-3x slower, for
# the whole run or a window of it) stays on the scale.
OFF_SCALE_X_MEDIAN = 10.0


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


def colour_scale(picture: StepPicture) -> tuple[float, float]:
    """(vmin, vmax) of the heat map: the cells' range, less those off the scale."""
    import numpy as np

    values = np.array(
        [v for row in picture.compute_s for v in row if v is not None and np.isfinite(v)]
    )
    if values.size == 0:
        return 0.0, 1.0
    on_scale = values[values <= OFF_SCALE_X_MEDIAN * np.median(values)]
    low, high = float(values.min()), float(on_scale.max())
    return low, high if high > low else low + 1e-9


def render(picture: StepPicture, out: Path, *, threshold: float | None = None) -> Any:
    """Write the PNG and return the matplotlib Figure (tests read the plotted data from it:
    its axes are labelled "timeline", "heat" and "band")."""
    plt = _pyplot()

    rows = len(picture.ranks)
    height_in = min(3 + 0.25 * rows, 30)
    fig, (line, heat, band) = plt.subplots(
        3,
        1,
        figsize=(12, height_in + 6),
        dpi=DPI,
        gridspec_kw={"height_ratios": [3.5, height_in, 2.5]},
    )
    # Room on the left for the rank labels (rank, node, slowest window), and between panels.
    fig.subplots_adjust(left=0.22, right=0.9, hspace=0.4)
    line.set_label("timeline")
    heat.set_label("heat")
    band.set_label("band")
    band.sharex(heat)
    _heat_map(plt, picture, heat, fig, band)
    _band(picture, band, threshold)
    _action_lines(picture, heat, band)
    _timeline(picture, line)
    fig.savefig(out, dpi=DPI)
    return fig


def _heat_map(plt: Any, picture: StepPicture, heat: Any, fig: Any, band: Any) -> Any:
    import numpy as np

    rows, width = len(picture.ranks), len(picture.columns)
    data = np.ma.masked_invalid(np.array(picture.compute_s, dtype=float))
    # Steps a rank never finished (hung, gone, not started yet) are light grey holes; cells past
    # the scale are magenta.
    cmap = plt.get_cmap("viridis").with_extremes(bad=MISSING_COLOUR, over=OVER_COLOUR)
    vmin, vmax = colour_scale(picture)
    image = heat.imshow(
        data,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        vmin=vmin,
        vmax=vmax,
        extent=(-0.5, width - 0.5, rows - 0.5, -0.5),
    )
    # One colour bar for both panels keeps their step axes the same width, aligned.
    fig.colorbar(
        image, ax=[heat, band], label="own compute time per step (s)", pad=0.01, extend="max"
    )
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
    return image


def _band(picture: StepPicture, band: Any, threshold: float | None) -> None:
    import numpy as np

    width = len(picture.columns)
    x = np.arange(width)
    median = np.array([np.nan if v is None else v for v in picture.median_s])
    low = np.array([np.nan if v is None else v for v in picture.band_low_s])
    high = np.array([np.nan if v is None else v for v in picture.band_high_s])
    band.fill_between(x, low, high, color="tab:blue", alpha=0.25, label="25-75% of ranks")
    band.plot(x, median, color="tab:blue", label="median")
    if threshold is not None:
        band.plot(x, median * (1 + threshold), "--", color="grey", label="straggler threshold")
    flagged = {rank: mark.kind for mark in picture.flags for rank in mark.ranks}
    for rank in sorted(flagged):
        row = np.array(
            [np.nan if v is None else v for v in picture.compute_s[picture.ranks.index(rank)]]
        )
        band.plot(x, row, color=FLAG_COLOURS.get(flagged[rank], "tab:red"), label=f"rank {rank}")
    band.set_ylabel("seconds")
    band.legend(loc="upper left", fontsize=7, ncols=4)
    ticks = np.linspace(0, width - 1, num=min(width, 10)).round().astype(int)
    band.set_xticks(ticks)
    band.set_xticklabels([str(picture.columns[t][0]) for t in ticks])
    band.set_xlabel("step")


def _action_lines(picture: StepPicture, heat: Any, band: Any) -> None:
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


def _timeline(picture: StepPicture, ax: Any) -> None:
    """World size and step rate over wall-clock time, the failures (crimson lines) with the
    time each cost shaded by cause, restarts, requeues and actions."""
    timeline = picture.timeline
    ax.set_title("wall-clock timeline (seconds from the first step)")
    if timeline is None:
        ax.text(0.5, 0.5, "no timeline", ha="center", va="center", transform=ax.transAxes)
        return
    x = [b.start_s + b.width_s / 2 for b in timeline.bins]
    ax.step(x, [b.world_size for b in timeline.bins], where="mid", color="tab:blue",
            label="world size")  # fmt: skip
    ax.set_ylabel("ranks")
    ax.set_ylim(0, max([b.world_size for b in timeline.bins], default=1) * 1.3 + 1)
    rate = ax.twinx()
    rate.plot(x, [b.step_rate for b in timeline.bins], color="tab:green", lw=0.8, label="steps/s")
    rate.set_ylabel("steps/s")
    rate.set_ylim(0, max([b.step_rate for b in timeline.bins], default=1) * 1.3 + 1e-9)
    shaded: set[str] = set()
    for failure in timeline.failures:
        for cause, start, end in failure.spans:
            label = f"lost: {cause}" if cause not in shaded else None
            shaded.add(cause)
            ax.axvspan(start, end, color=CAUSE_COLOURS[cause], alpha=0.7, lw=0, label=label)
    for failure in timeline.failures:
        ax.axvline(failure.at_s, color=FAILURE_COLOUR, lw=2)
        lost = "" if failure.lost_s is None else f" ({failure.lost_s:.0f} s lost"
        lost += "" if failure.lost_s is None else (", est.)" if failure.estimate else ")")
        ax.text(failure.at_s, ax.get_ylim()[1] * 0.97, f" {failure.kind}{lost}", rotation=90,
                va="top", fontsize=7, color=FAILURE_COLOUR)  # fmt: skip
    for moment in timeline.restarts:
        ax.axvline(moment.at_s, color="grey", lw=0.8, ls="--")
    for moment in timeline.requeues:
        ax.axvline(moment.at_s, color="tab:purple", lw=1.2, ls="-.")
    for moment in timeline.actions:
        ax.plot(moment.at_s, ax.get_ylim()[1] * 0.05, marker="^", color="black", markersize=4)
    ax.set_xlim(0, timeline.end_s)
    ax.set_xlabel("seconds")
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = rate.get_legend_handles_labels()
    ax.legend(handles + more, labels + more_labels, loc="upper right", fontsize=7, ncols=3)


def _rank_label(rank: int, picture: StepPicture) -> str:
    """The rank, its node, and its slowest window (not the whole-run median, which a late
    straggler hides)."""
    node = picture.nodes.get(rank)
    label = f"rank {rank}" + (f" ({node})" if node else "")
    worst = picture.worst_window.get(rank)
    if worst is not None:
        return label + f" x{worst[0]:.2f} (steps {worst[1]}-{worst[2]})"
    slow = picture.slowdown.get(rank)
    return label + (f" x{slow:.2f}" if slow is not None else "")
