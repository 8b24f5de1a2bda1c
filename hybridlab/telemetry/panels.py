"""The dashboard's diagnostic panels: what runs now, memory, device busy, rollout, resharding.

Each panel takes the telemetry records of one poll (``feed``) and streams only new points;
``ROLLOVER`` bounds every data source (a long run keeps its newest points). The status and the
curves live in ``dashboard.py``, which places these panels on the page.
"""
from __future__ import annotations

import html
import operator
import time
from pathlib import Path

from hybridlab.telemetry.heatmap import HeatMap
from hybridlab.telemetry.memory import leak_check

ROLLOVER = {"memory": 3600, "markers": 2000, "busy": 5000, "lengths": 5000, "matrix": 4096, "mismatch": 5000,
            "agent": 5000, "moe": 5000, "stream": 5000, "training": 100_000}
COMMON = dict(height=240, sizing_mode="stretch_width", toolbar_location="above")


def ema(values: list[float], weight: float, state: tuple[float, int] = (0.0, 0)) -> tuple[list[float], tuple]:
    """Return TensorBoard's smoothing of ``values`` (an exponential moving average of ``weight``,
    debiased so the first points are not pulled toward 0; NaN and inf pass through as they are)
    and the state to continue it with the next values."""
    last, n = state
    out = []
    for value in values:
        if value != value or value in (float("inf"), float("-inf")):
            out.append(value)
            continue
        last, n = last * weight + (1 - weight) * value, n + 1
        out.append(last / (1 - weight ** n))
    return out, (last, n)


STACK_CHARS = 6000     # of each stack file shown on the page (the file has all of it)
STACK_CARDS = 64       # stack files shown (newest first)
MEMORY_LINES = 8       # workers drawn as memory lines; more are read from the memory heat map
HISTORY_SAMPLES = 1000  # memory samples in one poll that re-run the leak check (a history handed over late)


def worker_label(r: dict) -> str:
    """Return the label of the worker a record comes from: ``role r<rank>``."""
    return f"{r['role']} r{r['rank']}"


class RunningPanel:
    """Every worker call in flight with its age; calls past their stuck-call deadline in red;
    the stacks the controller wrote, one collapsed card per worker, newest dump first."""

    kinds = ("running", "stacks")  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        import panel as pn

        self.calls, self.stack_files = [], []
        self.table = pn.pane.HTML(self._html(), name="running", sizing_mode="stretch_width")
        self.stacks = pn.Column(sizing_mode="stretch_width", name="stacks")
        self.layout = pn.Column(pn.pane.Markdown("### Now running"), self.table,
                                pn.pane.Markdown("### Stacks (newest first)"), self.stacks,
                                sizing_mode="stretch_width")

    def feed(self, records: list[dict]) -> None:
        """Take the newest ``running`` snapshot and any written stacks from ``records``."""
        for r in records:
            if r.get("kind") == "running":
                self.calls = r.get("calls", [])
            elif r.get("kind") == "stacks" and not r.get("error"):
                self.stack_files = r.get("files", [])
                self.stacks[:] = (self._cards(r) + list(self.stacks))[:STACK_CARDS]
        self.table.object = self._html()

    def late(self, now: float | None = None) -> bool:
        """Return True while a call in flight is past its stuck-call deadline."""
        now = time.time() if now is None else now
        return any(now - c["start"] > c["deadline_s"] for c in self.calls)

    def _html(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        if not self.calls:
            return "<p>no worker call in flight</p>"
        rows = []
        for c in self.calls:
            age = now - c["start"]
            late = age > c["deadline_s"]
            style = ' style="color:#c62828;font-weight:bold"' if late else ""
            ranks = ",".join(str(k) for k in c.get("ranks", []))
            rows.append(f"<tr{style}><td>{html.escape(c['role'])}</td><td>{ranks}</td>"
                        f"<td>{html.escape(c['method'])}</td><td>{html.escape(c.get('stage') or '')}</td>"
                        f"<td>{age:.1f} s</td><td>{c['deadline_s']:.0f} s{' (stuck)' if late else ''}</td></tr>")
        head = "<tr><th>role</th><th>ranks</th><th>method</th><th>stage</th><th>running for</th><th>deadline</th></tr>"
        return f"<table>{head}{''.join(rows)}</table>"

    def _cards(self, r: dict) -> list:
        """Return one collapsed card per stack file of a ``stacks`` record."""
        import panel as pn

        cards = []
        for name in r.get("files", []):
            path = Path(name)
            text = path.read_text(errors="replace")[:STACK_CHARS] if path.is_file() else "(file not readable here)"
            cards.append(pn.Card(pn.pane.Markdown(f"```\n{text}\n```", sizing_mode="stretch_width"),
                                 title=path.name, collapsed=True, sizing_mode="stretch_width"))
        return cards


class MemoryPanel:
    """Resident memory per worker over time (and torch's CUDA memory where there is one), step
    ends marked, and the leak alarm of ``telemetry.memory``."""

    kinds = ("device", "metrics")  # the records it reads (the dashboard hands it only these)

    def __init__(self, clock):
        import panel as pn
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure

        self.clock, self.sources, self.samples, self.step_ends = clock, {}, {}, []
        self.fig = figure(title="resident memory per worker (MB; GPU: torch allocated, dashed)",
                          x_axis_label="seconds", **COMMON)
        self.heat = HeatMap(f"resident memory per worker (MB, mean per time bin): more than {MEMORY_LINES} workers",
                            "seconds since the run started", "MB", bin_width=5.0, high=None)
        self.heat.fig.visible = False  # shown when there are more workers than lines
        self.markers = ColumnDataSource({"t": [], "step": [], "y": []})  # y: just under the lines
        self.fig.scatter("t", "y", source=self.markers, marker="triangle", size=6, color="#555555",
                         legend_label="step end")
        self.alarm = pn.pane.Markdown("", name="leak alarm")
        self.leaks: dict[str, dict] = {}

    def feed(self, records: list[dict]) -> None:
        """Stream new memory samples and step ends; re-check the alarm when steps ended."""
        rows: dict[str, dict[float, dict]] = {}
        ends = [r for r in records if r.get("kind") == "metrics" and "time" in r]
        for r in records:
            if r.get("kind") == "device":
                rows.setdefault(worker_label(r), {})[r["time"]] = r  # one per process and time
        nan = float("nan")
        for label, by_time in rows.items():
            if label not in self.samples:
                self.samples[label] = ([], [])
                if len(self.samples) <= MEMORY_LINES:
                    self._add_lines(label)
            times = sorted(by_time)
            picked = [by_time[t] for t in times]
            mb = [r["rss_mb"] if "rss_mb" in r else r.get("memory_mb", nan) for r in picked]
            shift = self.clock(times[0]) - times[0]  # seconds since the run started
            clock = [t + shift for t in times]
            if label in self.sources:
                self.sources[label].stream({"t": clock, "mb": mb, "gpu_mb": [r.get("gpu_allocated_mb", nan)
                                                                             for r in picked]},
                                           rollover=ROLLOVER["memory"])
            self.heat.add([label] * len(clock), clock, mb)
            self.samples[label][0].extend(times)
            self.samples[label][1].extend(mb)
        if len(self.samples) > MEMORY_LINES and not self.heat.fig.visible:
            self.heat.fig.visible = True
            self.fig.title.text = (f"resident memory of the first {MEMORY_LINES} workers (MB; GPU dashed;"
                                   " every worker in the heat map)")
        self.heat.flush()
        if ends:
            self.step_ends += [r["time"] for r in ends]
            floor = min((min(v[1][-60:]) for v in self.samples.values() if v[1]), default=0.0)
            self.markers.stream({"t": [self.clock(r["time"]) for r in ends], "step": [r["step"] for r in ends],
                                 "y": [floor] * len(ends)}, rollover=ROLLOVER["markers"])
        if ends or sum(len(v) for v in rows.values()) >= HISTORY_SAMPLES:  # steps ended, or a history arrived
            self._check()

    def _add_lines(self, label: str) -> None:
        from bokeh.models import ColumnDataSource
        from bokeh.palettes import Category10_10

        self.sources[label] = ColumnDataSource({"t": [], "mb": [], "gpu_mb": []})
        color = Category10_10[len(self.sources) % 10]
        self.fig.line("t", "mb", source=self.sources[label], legend_label=label, color=color)
        self.fig.line("t", "gpu_mb", source=self.sources[label], color=color, line_dash="dashed")

    def _check(self) -> None:
        self.leaks = {label: check for label, (t, mb) in self.samples.items()
                      if (check := leak_check(t, mb, self.step_ends)) is not None}
        leaking = {k: v for k, v in self.leaks.items() if v["leak"]}
        if leaking:
            worst = ", ".join(f"{k} +{v['slope_mb']:.1f} MB ({v['slope_pct']:.1f}%)" for k, v in leaking.items())
            self.alarm.object = f"<span style='color:#c62828'>**memory grows after warm-up** (per 100 steps): {worst}</span>"
        elif self.leaks:
            self.alarm.object = "memory: no worker grows after warm-up"


BUSY = "perf/device_busy/"


class BusyPanel:
    """Per device, the share of each step it spent in worker calls (``perf/device_busy``), as a
    device x step heat map (bins of steps merge on long runs)."""

    kinds = ("metrics",)  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        self.heat = HeatMap("device busy per step (share of the step in worker calls; mean per bin of steps)",
                            "step (bins)", "busy share", bin_width=1, high=1.0)
        self.fig = self.heat.fig
        self.keys: dict[tuple, list[str]] = {}  # a metrics record's keys -> its perf/device_busy/DEVICE keys

    def feed(self, records: list[dict]) -> None:
        """Add the ``perf/device_busy/*`` metrics of new steps, one row per device."""
        groups: dict[tuple, list[dict]] = {}  # steps log the same keys: one grid per key set
        for r in records:
            if r.get("kind") == "metrics":
                groups.setdefault(tuple(r), []).append(r)
        for keys, group in groups.items():
            busy = self.keys.get(keys)
            if busy is None:
                if len(self.keys) > 1000:  # steps whose keys keep changing: keep the cache small
                    self.keys.clear()
                busy = self.keys[keys] = [k for k in keys if k.startswith(BUSY)]
            if busy:
                values = list(map(operator.itemgetter(*busy), group))  # a row of values per step (one: a value)
                self.heat.add_grid([k[len(BUSY):] for k in busy], [r["step"] for r in group], values)
        self.heat.flush()


class RolloutPanel:
    """Response lengths per step (p10-p90 band, median, max), tokens/s and the straggler share."""

    kinds = ("metrics",)  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure

        self.source = ColumnDataSource({"step": [], "p10": [], "p50": [], "p90": [], "max": [],
                                        "tokens_per_s": [], "straggler_pct": []})
        self.lengths = figure(title="response length per step: p10-p90 band, median, max", x_axis_label="step",
                              **COMMON)
        self.lengths.varea("step", "p10", "p90", source=self.source, fill_alpha=0.3, color="#4e79a7",
                           legend_label="p10-p90")
        self.lengths.line("step", "p50", source=self.source, color="#4e79a7", legend_label="median")
        self.lengths.line("step", "max", source=self.source, color="#e15759", legend_label="max")
        self.speed = figure(title="rollout tokens/s (line) and straggler share % (bars: decode steps for the"
                                  " longest 10%)", x_axis_label="step", **COMMON)
        self.speed.vbar(x="step", top="straggler_pct", width=0.8, source=self.source, color="#bab0ac")
        self.speed.line("step", "tokens_per_s", source=self.source, color="#4e79a7")

    def feed(self, records: list[dict]) -> None:
        """Stream the response-length and rollout metrics of new steps."""
        rows = [r for r in records if r.get("kind") == "metrics" and "response_length/p50" in r]
        if rows:
            def tps(r):
                seconds = r.get("timing/generate_s") or 0
                return r.get("rollout/tokens", 0) / seconds if seconds else float("nan")
            self.source.stream({"step": [r["step"] for r in rows],
                                **{k: [r[f"response_length/{k}"] for r in rows] for k in ("p10", "p50", "p90", "max")},
                                "tokens_per_s": [tps(r) for r in rows],
                                "straggler_pct": [100 * r.get("rollout/straggler_share", 0.0) for r in rows]},
                               rollover=ROLLOVER["lengths"])


MISMATCH_WAITING = ("*no rollout-vs-trainer metrics yet: they come from steps that recompute the old log-probs"
                    " (`old_logprob`) or run rollout correction in bypass mode; this run's steps take the"
                    " rollout's log-probs as they are*")


class MismatchPanel:
    """The rollout-vs-trainer mismatch per step (``rollout_corr/`` metrics): KL and k3-KL of the
    log-probs, the mean IS weight and the rejected share of tokens, when the step measured them
    (a step that recomputes old log-probs, or rollout correction in bypass mode)."""

    kinds = ("metrics",)  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        import panel as pn
        from bokeh.models import ColumnDataSource, LinearAxis, Range1d
        from bokeh.plotting import figure

        self.source = ColumnDataSource({"step": [], "kl": [], "k3_kl": [], "is_mean": [], "rejected_pct": []})
        self.fig = figure(title="rollout vs trainer: KL, k3-KL (left); mean IS weight, rejected % (right)",
                          x_axis_label="step", **COMMON)
        self.fig.line("step", "kl", source=self.source, color="#4e79a7", legend_label="KL")
        self.fig.line("step", "k3_kl", source=self.source, color="#f28e2b", legend_label="k3-KL")
        self.fig.extra_y_ranges = {"right": Range1d(0, 2)}
        self.fig.add_layout(LinearAxis(y_range_name="right"), "right")
        self.fig.scatter("step", "is_mean", source=self.source, y_range_name="right", color="#59a14f",
                         legend_label="IS weight mean")
        self.fig.vbar(x="step", top="rejected_pct", width=0.8, source=self.source, y_range_name="right",
                      color="#e15759", alpha=0.4, legend_label="rejected % / 100")
        self.fig.legend.location = "top_left"
        self.fig.visible = False  # until a step measures the mismatch; the note says why it is empty
        self.note = pn.pane.Markdown(MISMATCH_WAITING, name="mismatch note")
        self.layout = pn.Column(self.note, self.fig, sizing_mode="stretch_width")

    def feed(self, records: list[dict]) -> None:
        """Stream the mismatch metrics of new steps that have them (the first shows the plot)."""
        rows = [r for r in records if r.get("kind") == "metrics" and "rollout_corr/kl" in r]
        if rows:
            self.note.visible, self.fig.visible = False, True
            nan = float("nan")
            self.source.stream({"step": [r["step"] for r in rows], "kl": [r["rollout_corr/kl"] for r in rows],
                                "k3_kl": [r.get("rollout_corr/k3_kl", nan) for r in rows],
                                "is_mean": [r.get("rollout_corr/rollout_is_mean", nan) for r in rows],
                                "rejected_pct": [r.get("rollout_corr/rollout_rs_masked_fraction", 0.0) for r in rows]},
                               rollover=ROLLOVER["mismatch"])


class ReshardPanel:
    """The last weight sync's plan as a trainer-rank x rollout-rank matrix of MB, with its cost."""

    kinds = ("sync", "metrics")  # the records it reads (the dashboard hands it only these)

    def __init__(self):
        import panel as pn
        from bokeh.models import ColumnDataSource
        from bokeh.plotting import figure

        self.matrix = ColumnDataSource({"src": [], "dst": [], "mb": [], "label": [], "alpha": []})
        self.fig = figure(title="last sync: MB from trainer rank (y) to rollout rank (x)", x_axis_label="rollout rank",
                          y_axis_label="trainer rank", **COMMON)
        self.fig.rect("dst", "src", 0.95, 0.95, source=self.matrix, fill_color="#9c755f", fill_alpha="alpha",
                      line_color=None)
        self.fig.text("dst", "src", text="label", source=self.matrix, text_align="center", text_baseline="middle",
                      text_font_size="11px")
        self.caption = pn.pane.Markdown("", name="last sync")
        self.step_s: dict[int, float] = {}   # bounded below: only the steps near the last sync matter
        self.last: dict | None = None

    def feed(self, records: list[dict]) -> None:
        """Show the newest sync's bytes per (trainer rank, rollout rank) and its share of the step."""
        syncs = [r for r in records if r.get("kind") == "sync"]
        for r in records:
            if r.get("kind") == "metrics" and r.get("timing/step_s"):
                self.step_s[r["step"]] = r["timing/step_s"]
                self.step_s.pop(r["step"] - 100, None)
        if syncs:
            self._show(syncs[-1])
        if self.last is not None:  # the step's time arrives after its sync
            step_s = self.step_s.get(self.last.get("step"))
            share = f", {100 * self.last['seconds'] / step_s:.1f}% of step {self.last['step']}" if step_s else ""
            self.caption.object = (f"last sync ({self.last.get('reason', 'step')}, {self.last.get('mode', '')}): "
                                   f"{self.last['bytes'] / 2**20:.1f} MB in {self.last.get('buckets', 0)} bucket(s),"
                                   f" {self.last['seconds']:.2f} s{share}")

    def _show(self, last: dict) -> None:
        self.last = last
        pairs = [(tuple(int(x) for x in k.split("->")), v) for k, v in (last.get("bytes_per_pair") or {}).items()]
        top = max((v for _, v in pairs), default=1) or 1
        self.matrix.data = {"src": [s for (s, _), _ in pairs], "dst": [d for (_, d), _ in pairs],
                            "mb": [v / 2**20 for _, v in pairs], "label": [f"{v / 2**20:.1f}" for _, v in pairs],
                            "alpha": [0.2 + 0.8 * v / top for _, v in pairs]}  # replaced, never grows
