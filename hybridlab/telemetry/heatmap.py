"""A device x time heat map that stays readable and light at any scale.

Lines, one per device, stop reading at a few dozen devices; a heat map reads at 64 and beyond:
one row per device, one cell per bin of x (seconds or steps), the colour the bin's mean.
Samples are summed into bins as they arrive (numpy arrays of sums and counts, a row per
device), a bin still filling is patched in place on the page, and when the history spans more
than ``max_bins`` bins, neighbouring bins merge (the bin width doubles as often as needed), so
the page draws at most rows x ``max_bins`` cells however long the run. The full samples stay in
the run's ``telemetry.jsonl``.
"""
from __future__ import annotations

import re

import numpy as np

PALETTE = "Viridis256"


class HeatMap:
    """Rows (devices) x bins of ``x``; ``add`` samples, then ``flush`` sends what changed to the page."""

    def __init__(self, title: str, x_label: str, value_label: str, bin_width: float, high: float | None,
                 max_bins: int = 300, height: int = 260):
        """``high``: the value at the top of the colour scale (None: the largest value seen)."""
        from bokeh.models import ColorBar, ColumnDataSource, FactorRange, HoverTool
        from bokeh.plotting import figure
        from bokeh.transform import linear_cmap

        self.width, self.max_bins, self.height = float(bin_width), max_bins, height
        self.rows: dict[str, int] = {}
        self.sums = np.zeros((0, 0))
        self.counts = np.zeros((0, 0))
        self.origin: int | None = None        # the bin (of the current width) that column 0 holds
        self.touched: tuple[int, int] | None = None  # the columns changed since the last flush
        self.index: dict[tuple[int, int], int] = {}  # (row, column) -> its row in the data source
        self.resend = False
        self.source = ColumnDataSource({"x": [], "row": [], "value": [], "width": []})
        self.fig = figure(title=title, x_axis_label=x_label, y_range=FactorRange(), height=height,
                          sizing_mode="stretch_width", toolbar_location="above")
        self.auto_high = high is None
        mapper = linear_cmap("value", PALETTE, low=0, high=high or 1.0, nan_color="#dddddd")
        self.mapper = mapper["transform"]
        cells = self.fig.rect(x="x", y="row", width="width", height=0.95, source=self.source, fill_color=mapper,
                              line_color=None)
        self.fig.add_tools(HoverTool(renderers=[cells], tooltips=[("device", "@row"), (x_label, "@x{0,0.[0]}"),
                                                                  (value_label, "@value{0,0.[00]}")]))
        self.fig.add_layout(ColorBar(color_mapper=self.mapper, title=value_label), "right")

    def add(self, rows: list[str], xs: list[float], values: list[float]) -> None:
        """Count samples: ``values[i]`` of row ``rows[i]`` at ``xs[i]`` (NaN values and times are not
        counted; a sample before the first one seen goes into the first bin)."""
        self._add(np.array([self._row(row) for row in rows], dtype=np.int64), xs, values)

    def add_grid(self, rows: list[str], xs: list[float], values) -> None:
        """Count a grid of samples: ``values[i][j]`` of row ``rows[j]`` at ``xs[i]`` (None or NaN:
        not counted); the same as ``add`` of every cell, without a Python object per cell."""
        grid = np.asarray(values, dtype=float).reshape(len(xs), len(rows))
        index = np.array([self._row(row) for row in rows], dtype=np.int64)
        self._add(np.tile(index, len(xs)), np.repeat(np.asarray(xs, dtype=float), len(rows)), grid.ravel())

    def _row(self, name: str) -> int:
        """Return the index of row ``name`` (a new row is added and the page redrawn)."""
        if name not in self.rows:
            self.rows[name] = len(self.rows)
            self.resend = True
        return self.rows[name]

    def _add(self, r: np.ndarray, xs, values) -> None:
        values, xs = np.asarray(values, dtype=float), np.asarray(xs, dtype=float)
        keep = ~np.isnan(values) & np.isfinite(xs)
        if not keep.any():
            return
        r = r[keep]
        bins = np.floor(xs[keep] / self.width).astype(np.int64)
        if self.origin is None:
            self.origin = int(bins.min())
        factor = 1
        while (int(bins.max()) // factor - self.origin // factor) >= self.max_bins:
            factor *= 2
        if factor > 1:
            self._merge(factor)
            bins //= factor
        columns = np.maximum(bins - self.origin, 0)
        self._grow(len(self.rows), int(columns.max()) + 1)
        shape = self.sums.shape
        flat = r * shape[1] + columns
        self.sums += np.bincount(flat, weights=values[keep], minlength=shape[0] * shape[1]).reshape(shape)
        self.counts += np.bincount(flat, minlength=shape[0] * shape[1]).reshape(shape)
        low, high = int(columns.min()), int(columns.max())
        self.touched = (low, high) if self.touched is None else (min(low, self.touched[0]), max(high, self.touched[1]))
        if self.auto_high and values[keep].max() > self.mapper.high:
            self.mapper.high = float(values[keep].max())

    def flush(self) -> None:
        """Send the cells changed since the last flush to the page: new cells streamed, filling
        ones patched; after new rows or a merge, every cell anew."""
        if self.touched is None:
            return
        names = sorted(self.rows, key=natural, reverse=True)  # the first on top
        if list(self.fig.y_range.factors) != names:
            self.fig.y_range.factors = names
            self.fig.height = max(self.height, 60 + 12 * len(names))
        low, high = self.touched
        self.touched = None
        if self.resend or not self.index:
            self._send_all()
            return
        r, c = np.nonzero(self.counts[:, low:high + 1])
        cells = list(zip(r.tolist(), (c + low).tolist()))
        old = [cell for cell in cells if cell in self.index]
        new = [cell for cell in cells if cell not in self.index]
        if old:
            self.source.patch({"value": [(self.index[cell], self._mean(*cell)) for cell in old]})
        if new:
            start = len(self.source.data["x"])
            self.index.update({cell: start + i for i, cell in enumerate(new)})
            self.source.stream(self._columns(new))

    def cut(self, last: float) -> None:
        """Forget the bins that start after ``last`` (a roll-back will log them again). Once bins
        have merged, the bin holding ``last`` keeps the rolled-back samples it also holds."""
        if self.origin is None:
            return
        first = max(int(np.floor(last / self.width)) + 1 - self.origin, 0)
        self.sums[:, first:] = 0
        self.counts[:, first:] = 0
        self._send_all()

    def _mean(self, row: int, column: int) -> float:
        return float(self.sums[row, column] / self.counts[row, column])

    def _columns(self, cells: list[tuple[int, int]]) -> dict:
        names = list(self.rows)
        return {"x": [(self.origin + c + 0.5) * self.width for _, c in cells], "row": [names[r] for r, _ in cells],
                "value": [self._mean(r, c) for r, c in cells], "width": [self.width] * len(cells)}

    def _grow(self, rows: int, columns: int) -> None:
        if self.sums.shape[0] >= rows and self.sums.shape[1] >= columns:
            return
        width = self.sums.shape[1]
        shape = (max(rows, self.sums.shape[0]), width if columns <= width else max(columns, 2 * width, 16))
        for name in ("sums", "counts"):
            grown = np.zeros(shape)
            old = getattr(self, name)
            grown[:old.shape[0], :old.shape[1]] = old
            setattr(self, name, grown)

    def _merge(self, factor: int) -> None:
        """Widen the bins ``factor`` times (a power of 2): each ``factor`` neighbouring bins become one."""
        shift = self.origin % factor  # column 0 must start a merged bin
        for name in ("sums", "counts"):
            old = getattr(self, name)
            if old.size == 0:
                continue
            padded = np.zeros((old.shape[0], -(-(old.shape[1] + shift) // factor) * factor))
            padded[:, shift:shift + old.shape[1]] = old
            setattr(self, name, padded.reshape(old.shape[0], -1, factor).sum(axis=2))
        self.origin //= factor
        self.width *= factor
        self.resend = True

    def _send_all(self) -> None:
        r, c = np.nonzero(self.counts)
        order = np.lexsort((r, c))
        cells = list(zip(r[order].tolist(), c[order].tolist()))
        self.index = {cell: i for i, cell in enumerate(cells)}
        self.source.data = self._columns(cells)
        self.resend = False


def natural(label: str) -> tuple:
    """Return a sort key that puts ``gpu2`` before ``gpu10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", label))
