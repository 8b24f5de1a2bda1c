"""A device x time heat map that stays readable and light at any scale.

Lines, one per device, stop reading at a few dozen devices; a heat map reads at 64 and beyond:
one row per device, one cell per time bin, the colour the bin's mean. Samples are summed into
bins as they arrive (a bin still filling is patched in place), and when the history spans more
than ``max_bins`` bins, neighbouring bins merge (the bin width doubles), so the page draws at
most rows x ``max_bins`` cells however long the run. The full samples stay in the run's
``telemetry.jsonl``.
"""
from __future__ import annotations

from collections import defaultdict

PALETTE = "Viridis256"


class HeatMap:
    """Rows (devices) x bins of ``x`` (seconds or steps); ``add`` samples, then ``flush`` to the page."""

    def __init__(self, title: str, x_label: str, value_label: str, bin_width: float, high: float,
                 max_bins: int = 300, height: int = 260):
        from bokeh.models import ColorBar, ColumnDataSource, FactorRange, HoverTool
        from bokeh.plotting import figure
        from bokeh.transform import linear_cmap

        self.width, self.max_bins, self.height = bin_width, max_bins, height
        self.bins: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])  # (row, bin) -> [sum, n]
        self.index: dict[tuple[str, int], int] = {}     # (row, bin) -> its row in the data source
        self.dirty: set[tuple[str, int]] = set()
        self.source = ColumnDataSource({"x": [], "row": [], "value": [], "width": []})
        self.fig = figure(title=title, x_axis_label=x_label, y_range=FactorRange(), height=height,
                          sizing_mode="stretch_width", toolbar_location="above")
        mapper = linear_cmap("value", PALETTE, low=0, high=high, nan_color="#dddddd")
        cells = self.fig.rect(x="x", y="row", width="width", height=0.95, source=self.source, fill_color=mapper,
                              line_color=None)
        self.fig.add_tools(HoverTool(renderers=[cells], tooltips=[("device", "@row"), (x_label, "@x{0,0.[0]}"),
                                                                  (value_label, "@value{0,0.[00]}")]))
        self.fig.add_layout(ColorBar(color_mapper=mapper["transform"], title=value_label), "right")

    def add(self, row: str, x: float, value: float) -> None:
        """Count one sample of ``row`` at ``x`` (NaN values are not counted)."""
        if value != value:
            return
        key = (row, int(x // self.width))
        cell = self.bins[key]
        cell[0] += value
        cell[1] += 1
        self.dirty.add(key)

    def flush(self) -> None:
        """Send the bins changed since the last flush to the page: new cells streamed, filling
        ones patched; a history grown past ``max_bins`` is merged and sent anew."""
        if not self.dirty:
            return
        rows = sorted({row for row, _ in self.bins}, key=natural, reverse=True)  # the first on top
        if list(self.fig.y_range.factors) != rows:
            self.fig.y_range.factors = rows
            self.fig.height = max(self.height, 60 + 12 * len(rows))
        first, last = min(b for _, b in self.bins), max(b for _, b in self.bins)
        if last - first + 1 > self.max_bins:
            while last - first + 1 > self.max_bins:
                self._merge()
                first, last = first // 2, last // 2
            self._resend()
            return
        new = [k for k in sorted(self.dirty, key=lambda k: k[1]) if k not in self.index]
        patches = [(self.index[k], self._mean(k)) for k in self.dirty if k in self.index]
        if patches:
            self.source.patch({"value": patches})
        if new:
            start = len(self.source.data["x"])
            self.index.update({k: start + i for i, k in enumerate(new)})
            self.source.stream(self._columns(new))
        self.dirty.clear()

    def cut(self, last: float) -> None:
        """Forget the bins that start after ``last`` (a roll-back will log them again)."""
        self.bins = defaultdict(lambda: [0.0, 0], {k: v for k, v in self.bins.items() if k[1] * self.width <= last})
        self._resend()

    def _mean(self, key: tuple[str, int]) -> float:
        total, n = self.bins[key]
        return total / n

    def _columns(self, keys: list[tuple[str, int]]) -> dict:
        return {"x": [(b + 0.5) * self.width for _, b in keys], "row": [r for r, _ in keys],
                "value": [self._mean(k) for k in keys], "width": [self.width] * len(keys)}

    def _merge(self) -> None:
        """Double the bin width: each pair of neighbouring bins becomes one."""
        merged: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])
        for (row, b), (total, n) in self.bins.items():
            cell = merged[(row, b // 2)]
            cell[0] += total
            cell[1] += n
        self.bins, self.width = merged, self.width * 2

    def _resend(self) -> None:
        keys = sorted(self.bins, key=lambda k: (k[1], k[0]))
        self.index = {k: i for i, k in enumerate(keys)}
        self.source.data = self._columns(keys)
        self.dirty.clear()


def natural(label: str) -> tuple:
    """Return a sort key that puts ``gpu2`` before ``gpu10``."""
    import re

    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", label))
