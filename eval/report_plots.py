"""The plots of ``eval/report.py``: what each one shows (:data:`PLOTS`) and how it is drawn with
matplotlib (:func:`plot_points`), markers labelled without overlaps (:func:`annotate_points`).

Every figure is a standalone :class:`matplotlib.figure.Figure` (no pyplot state), rendered with
the Agg canvas; the report saves it as PNG.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib import colormaps, rcParams
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import (
    FixedLocator,
    LogLocator,
    MaxNLocator,
    NullLocator,
    ScalarFormatter,
    StrMethodFormatter,
)
from matplotlib.transforms import Bbox


@dataclass(frozen=True)
class PlotSpec:
    """One plot: the point keys on its axes, their labels and scales, and what produces its data."""

    name: str
    title: str
    x: str
    y: str
    xlabel: str
    ylabel: str
    xscale: str  # "linear", "log" (base 10) or "log2"
    yscale: str
    lines: bool  # True: each series' points joined in x order; False: labelled markers
    missing: str  # which records or files would fill it
    ylim: tuple[float, float] | None = None  # fixed y limits of a bounded quantity (accuracy: 0..1)


PLOTS = (
    PlotSpec(
        name="recall_vs_state_bytes",
        title="Recall accuracy vs decode state",
        x="state_bytes",
        y="accuracy",
        xlabel="decode state (bytes / sequence, log scale)",
        ylabel="recall accuracy",
        xscale="log",
        yscale="linear",
        lines=False,
        missing="recall accuracy with state_bytes: eval/recall.py records (metric accuracy) or "
        "train.py's val/acc records",
        ylim=(0.0, 1.0),
    ),
    PlotSpec(
        name="accuracy_vs_length",
        title="Length generalisation",
        x="seqlen",
        y="accuracy",
        xlabel="sequence length (tokens)",
        ylabel="recall accuracy",
        xscale="log2",
        yscale="linear",
        lines=True,
        missing="recall accuracy with seqlen: eval/recall.py records (metric accuracy) or "
        "train.py's val/acc records",
        ylim=(0.0, 1.0),
    ),
    PlotSpec(
        name="val_loss_vs_tokens",
        title="Validation loss vs training tokens",
        x="train_tokens",
        y="val_loss",
        xlabel="training tokens",
        ylabel="validation loss (nats / token)",
        xscale="linear",
        yscale="linear",
        lines=True,
        missing="validation losses placed at training tokens: a metrics.csv with val/loss and "
        "train/tokens, val/loss records with train_tokens, or a W&B summary",
    ),
    PlotSpec(
        name="decode_tokens_per_s",
        title="Decode throughput",
        x="seqlen",
        y="tokens_per_s",
        xlabel="context length (tokens)",
        ylabel="decode tokens/s (log scale)",
        xscale="log2",
        yscale="log",
        lines=True,
        missing="eval/decode.py records (metric decode_tokens_per_s)",
    ),
)


def plot_points(points: list[dict[str, Any]], spec: PlotSpec) -> Figure | None:
    """Draw ``points`` (dicts with ``series``, ``spec.x`` and ``spec.y``; ``label`` annotates markers,
    ``linestyle`` styles a series' line) as one line or marker set per series, legend in series
    order; ``None`` when there are no points.

    Past 10 series the colours come from the 20-colour ``tab20`` map (the default cycle repeats
    after 10), past 20 they come round again with another marker shape, and past 6 the legend moves
    beside the axes. Run names are drawn as they are (a ``$`` is not mathtext). A ``log`` y axis whose data span less
    than a factor of 10 is drawn linear (a log axis over 350-361 only has unreadable minor ticks);
    x axes keep their scale (decode state bytes are compared on a log axis whatever their span), and
    a log axis spanning a decade or more puts its minor ticks at 2x and 5x only, so that labelled
    ones do not overlap (a log y axis under 4 decades labels each 1x, 2x and 5x tick as a plain
    number); within a decade it gets a few evenly spaced plain-number ticks. A spec's ``ylim``
    (accuracy: 0 to 1) fixes the y axis whatever the data: from ``ylim[0]`` to ``ylim[1]`` (labelled
    markers get 12% of that range more above, for their labels, without a tick), ticked at 6 evenly
    spaced values from one bound to the other; markers at a bound are drawn whole.
    The figure is a standalone :class:`matplotlib.figure.Figure` (no pyplot state to close).
    """
    if not points:
        return None
    by_series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        by_series[p["series"]].append(p)
    many = len(by_series) > 6
    fig = Figure(figsize=(11.5 if many else 7.5, 4.8), layout="constrained")
    ax = fig.subplots()
    palette = colormaps["tab20"].colors
    for i, (series, pts) in enumerate(sorted(by_series.items())):
        # past 20 series the colours come round again with another marker shape
        color = palette[i % len(palette)] if len(by_series) > 10 else None
        marker = _MARKERS[i // len(palette) % len(_MARKERS)]
        pts = sorted(pts, key=lambda p: p[spec.x])
        xs, ys = [p[spec.x] for p in pts], [p[spec.y] for p in pts]
        label = plain_text(series)
        # on fixed limits a marker at a bound (accuracy 0 or 1) is drawn whole, not cut by the frame
        clip = spec.ylim is None
        if spec.lines:
            style = pts[0].get("linestyle", "-")
            ax.plot(xs, ys, marker=marker, label=label, color=color, linestyle=style, clip_on=clip)
            continue
        ax.scatter(xs, ys, label=label, color=color, marker=marker, clip_on=clip)
    labels = {}
    for axis, set_scale, scale, key, label in (
        (ax.xaxis, ax.set_xscale, spec.xscale, spec.x, spec.xlabel),
        (ax.yaxis, ax.set_yscale, spec.yscale, spec.y, spec.ylabel),
    ):
        labels[key] = label
        if scale == "log2":
            set_scale("log", base=2)
            axis.set_major_formatter(ScalarFormatter())  # 64, 128, ... rather than 2^6, 2^7
        elif scale == "log" and axis is ax.yaxis and _narrow([p[key] for p in points]):
            set_scale("linear")
            labels[key] = label.replace(", log scale", "").replace(" (log scale)", "")
        else:
            set_scale(scale)
            values = [p[key] for p in points if p[key] > 0]
            if scale == "log" and values and max(values) >= 10 * min(values):
                # over a decade or more, minor ticks at 2x and 5x only: where matplotlib labels the
                # minor ticks of such a span, labels at every 2..9x (3x10^4, 4x10^4, ...) collide
                axis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
                if axis is ax.yaxis and max(values) < 10_000 * min(values):
                    # under 4 decades the 2x and 5x ticks are labelled too, all as plain numbers: a
                    # point at 40-55 tokens/s lay between 10^2 and unlabelled ticks; stacked up the
                    # y axis these labels do not collide
                    axis.set_major_formatter(StrMethodFormatter("{x:,.6g}"))
                    axis.set_minor_formatter(StrMethodFormatter("{x:,.6g}"))
            elif scale == "log" and values:
                # within a decade (30000-32000 bytes) matplotlib labels minor ticks 3x10^4,
                # 3.025x10^4, ... into each other: a few evenly spaced plain numbers instead, over
                # limits 1.25x around the points (a single point got a decade-wide default range,
                # whose evenly spaced ticks, 3e5 / 6e5 / 9e5, all lay far from a point at 1.04e5)
                (ax.set_xlim if axis is ax.xaxis else ax.set_ylim)(min(values) / 1.25, max(values) * 1.25)
                axis.set_major_locator(MaxNLocator(nbins=4))
                axis.set_major_formatter(ScalarFormatter(useOffset=False))
                axis.set_minor_locator(NullLocator())
    ax.set_xlabel(labels[spec.x])
    ax.set_ylabel(labels[spec.y])
    ax.set_title(spec.title)
    ax.grid(True, which="both", alpha=0.3)
    if many:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize="small")
    if spec.ylim is not None:
        low, high = spec.ylim
        # labelled markers get room above the top bound for their labels, and a little below the
        # bottom one, so that a marker at accuracy 0 is drawn whole rather than cut in half by the
        # axes; no tick is labelled there
        room = (0.0, 0.0) if spec.lines else (0.03 * (high - low), 0.12 * (high - low))
        ax.set_ylim(low - room[0], high + room[1])
        ax.yaxis.set_major_locator(FixedLocator(np.linspace(low, high, 6)))
    elif not spec.lines:
        ax.margins(y=0.12)  # room above the top markers and below the bottom ones for their labels
    if not spec.lines:
        annotate_points(fig, ax, points, spec)
    return fig


_MARKERS = ("o", "s", "^", "D", "v")


_MAX_LABEL_CHARS = 70  # longer labels keep their ends around an ellipsis


def plain_text(text: str) -> str:
    """``text`` for a matplotlib label, drawn as written: ``$`` escaped, which would otherwise start
    mathtext (a run named ``cost$\\x$`` failed the whole report); past :data:`_MAX_LABEL_CHARS`
    characters the middle is cut to an ellipsis (a 150-character run name squeezed the axes to
    nothing; the tables keep whole names)."""
    if len(text) > _MAX_LABEL_CHARS:
        keep = (_MAX_LABEL_CHARS - 1) // 2
        text = f"{text[:keep]}…{text[-keep:]}"
    return text.replace("$", r"\$")


# Where a marker's label may go, in points from the marker (and the text's alignment), tried in
# order: beside it above and below, right then left; then centred above and below; then further
# out, joined to the marker by a thin leader line.
_LABEL_OFFSETS = (
    (5, 5, "left"), (5, -13, "left"), (-5, 5, "right"), (-5, -13, "right"),
    (0, 8, "center"), (0, -17, "center"),
    (5, 16, "left"), (5, -24, "left"), (-5, 16, "right"), (-5, -24, "right"),
    (0, 22, "center"), (0, -31, "center"),
    (12, 30, "left"), (12, -38, "left"), (-12, 30, "right"), (-12, -38, "right"),
)  # fmt: skip
_LEADER_FROM = 6  # offsets from this index on get a leader line
_NEAR_MARKER_PT = 5.0  # a label keeps this far from other markers, so it is not read as theirs


def annotate_points(fig: Figure, ax, points: list[dict[str, Any]], spec: PlotSpec) -> None:
    """Label each marker of ``points`` (its ``label``, else its series) at the first offset of
    :data:`_LABEL_OFFSETS` whose text stays inside the axes, overlaps no label placed before it and
    keeps :data:`_NEAR_MARKER_PT` clear of other markers, measured on the rendered
    figure; where none is free, at the offset that overlaps least among those whose text lies inside
    the axes (off the tick labels, the title and the legend) and covers no label's text and no other
    marker. Where every offset would cover a label or a marker or leave the axes, as in a crowded
    cluster, the label is left out (the legend names every series) rather than drawn over another
    or cut. Far offsets draw a
    leader line to the marker. Markers are labelled left to right."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # final layout and limits, so data -> pixel positions hold
    renderer = canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    px = fig.dpi / 72  # pixels per point
    half = (rcParams["lines.markersize"] / 2 + 1) * px  # scatter's default marker, edge included
    centres = ax.transData.transform([(p[spec.x], p[spec.y]) for p in points])
    order = sorted(range(len(points)), key=lambda i: (points[i][spec.x], points[i][spec.y]))
    legend = ax.get_legend()
    # a legend inside the axes is an obstacle like a placed label
    placed: list[Bbox] = [legend.get_window_extent(renderer)] if legend is not None else []
    markers = [Bbox.from_bounds(x - half, y - half, 2 * half, 2 * half) for x, y in centres]
    texts: list[Bbox] = list(placed)  # the same without the leader lines' bounding rectangles
    for i in order:
        p = points[i]
        text = ax.annotate(
            plain_text(p.get("label", p["series"])),
            (p[spec.x], p[spec.y]),
            xytext=(0, 0),
            textcoords="offset points",
            fontsize=8,
            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkA": 0, "shrinkB": half / px},
        )
        text.set_in_layout(False)  # the layout measured above must not move when labels are added
        margin = half + _NEAR_MARKER_PT * px  # its own marker is no obstacle: the offsets clear it
        others = markers[:i] + markers[i + 1 :]
        obstacles = placed + [
            Bbox.from_bounds(x - margin, y - margin, 2 * margin, 2 * margin)
            for j, (x, y) in enumerate(centres)
            if j != i
        ]
        costs = []
        for k, (dx, dy, ha) in enumerate(_LABEL_OFFSETS):
            text.set_position((dx, dy))
            text.set_horizontalalignment(ha)
            box = text.get_window_extent(renderer)  # with its leader line's bounding rectangle
            cost = _area(box) - _area(Bbox.intersection(box, frame))
            cost += sum(_area(Bbox.intersection(box, other)) for other in obstacles)
            own = Text.get_window_extent(text, renderer)  # the text alone (positions updated above)
            # Inside the axes: past the figure's edge the saved picture cuts it (a new-user check
            # saw "linear" of "linear_attention" at the right-most marker), below and left of the
            # axes are the tick labels (a label below a marker at accuracy 0 sat on them), above is
            # the title and to the right the legend (20 runs' labels ran over both). And never over
            # another marker, which it would hide.
            inside = frame.x0 <= own.x0 and own.x1 <= frame.x1 and frame.y0 <= own.y0 and own.y1 <= frame.y1
            covers = any(_area(Bbox.intersection(own, marker)) for marker in others)
            if inside and not covers and not any(_area(Bbox.intersection(own, other)) for other in texts):
                costs.append((cost, k, box, own))
            if cost == 0:
                break
        if not costs:
            text.remove()
            continue
        _, k, box, own = min(costs, key=lambda c: c[0])
        texts.append(own)
        dx, dy, ha = _LABEL_OFFSETS[k]
        text.set_position((dx, dy))
        text.set_horizontalalignment(ha)
        text.arrow_patch.set_visible(k >= _LEADER_FROM)  # the leader line
        placed.append(box)


def _area(box: Bbox | None) -> float:
    """Area of ``box`` in square pixels; 0 for ``None`` (an empty intersection)."""
    return 0.0 if box is None else box.width * box.height


def _narrow(values: list[float]) -> bool:
    """Whether positive ``values`` span less than a factor of 10 (or hold a value <= 0)."""
    positive = [v for v in values if v is not None and v > 0]
    return len(positive) < len(values) or max(positive) < 10 * min(positive)
