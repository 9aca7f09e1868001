"""The bench scripts' figures: a grid of panels, one line per series, one PNG.

A *panel* is ``(title, series)``.  A *series* is ``(label, xs, ys)`` or
``(label, xs, ys, std)``; with ``std`` (not ``None``) the band
``ys - std .. ys + std`` is shaded in the line's colour.  A series with no
points is skipped but keeps its place: series ``k`` of every panel gets colour
``C{k}`` and line style ``linestyles[k % len(linestyles)]``, so one method has
the same look in all panels.

:func:`mean_series` turns the run records of bench/runner.py into a series
(mean ± std over seeds of the accuracy curves, in %).

Matplotlib is used without pyplot (a :class:`~matplotlib.figure.Figure` on the
Agg canvas, as fedaccel/results.py does), so no display is needed, the global
backend is left alone and there is no figure to close.  fedaccel's own plotting
(``fedaccel.results.plot_curves``, ``fedaccel.compare``) draws the fixed
two-panel "accuracy vs round / vs MB" figure of run folders, not a grid of
arbitrary series, hence this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import runner  # bench/runner.py, for mean_curve

LINESTYLES = ("-", "--", ":", "-.")


def mean_series(label: str, runs: list[dict[str, Any]], *, failed: int = 0) -> tuple:
    """``(label (n=..), rounds, mean %, std % or None)`` over ``runs`` (bench/runner.py
    records); no points when ``runs`` is empty.  ``failed`` runs are named in the label.
    The band (std) is only drawn for two or more runs."""
    if not runs:
        return (label, [], [])
    x, mean, std = runner.mean_curve(runs)
    note = f", {failed} failed" if failed else ""
    return (f"{label} (n={len(runs)}{note})", x, mean, std if len(runs) > 1 else None)


def plot_panels(
    panels: Sequence[tuple[str, Sequence[tuple]]],
    path: str | Path,
    *,
    xlabel: str | Sequence[str] = "round",
    ylabel: str | None = "test accuracy (%)",
    ncols: int | None = None,
    panel_size: tuple[float, float] = (6.5, 4.2),
    linestyles: Sequence[str] = ("-",),
    marker: str | None = None,
    logy: bool = False,
    ylim: tuple[float | None, float | None] | None = None,
    legend: Mapping[str, Any] | None = None,
    legend_panels: Sequence[int] | None = None,
    suptitle: str | None = None,
    dpi: int = 100,
):
    """Write ``panels`` to the PNG ``path``, row by row, ``ncols`` per row (default:
    all in one row); grid cells left over are blank.

    ``xlabel``: one label, or one per grid row.  ``ylabel``: ``None`` for none.
    ``legend``: keyword arguments of ``Axes.legend`` (default small, lower right);
    ``legend_panels``: indices of the panels that get one (default all).
    ``ylim``: ``(bottom, top)``, ``None`` for free.  ``suptitle``: a title over the grid.
    Creates the parent folder if needed; returns the (pyplot-free) Figure, for tests.
    """
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = ncols or max(1, len(panels))
    nrows = max(1, -(-len(panels) // ncols))
    xlabels = [xlabel] * nrows if isinstance(xlabel, str) else list(xlabel)
    legend = {"fontsize": 7, "loc": "lower right"} if legend is None else dict(legend)
    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows))
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for i, (ax, (title, series)) in enumerate(zip(axes, panels)):
        drawn = False
        for k, (label, xs, ys, *std) in enumerate(series):
            if len(xs) == 0:
                continue
            color = f"C{k % 10}"
            ax.plot(xs, ys, label=label, lw=1.2, ls=linestyles[k % len(linestyles)], color=color, marker=marker)
            if std and std[0] is not None:
                ys, sd = np.asarray(ys, dtype=float), np.asarray(std[0], dtype=float)
                ax.fill_between(xs, ys - sd, ys + sd, alpha=0.12, color=color)
            drawn = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabels[i // ncols])
        if ylabel:
            ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        if drawn and (legend_panels is None or i in legend_panels):
            ax.legend(**legend)
    for ax in axes[len(panels):]:
        ax.axis("off")
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return fig
