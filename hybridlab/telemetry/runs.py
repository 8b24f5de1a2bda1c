"""The runs page: every run under a folder with its status, last step and reward; the curves of
the selected runs overlaid. ``hybridlab dashboard RUNS_ROOT`` serves it.

A run is a directory holding ``metrics.jsonl`` or ``telemetry.jsonl`` (up to two levels below
the root). Its status: ``failed`` or ``finished`` from ``summary.json``; otherwise ``live`` when
a log was written in the last ``LIVE_S`` seconds (workers send a device sample every second),
else ``crashed``; ``resumed`` is added when it went on from a checkpoint. Logs are read
incrementally, so a refresh costs only what was appended since the last one.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from hybridlab.telemetry.axes import OVERLAY_TAG
from hybridlab.telemetry.hub import read_complete_lines

LIVE_S = 30.0
REFRESH_MS = 2000
ROLLOVER = 100_000     # points kept per overlaid curve
LOGS = ("metrics.jsonl", "telemetry.jsonl")


class RunInfo:
    """What the runs page knows about one run, updated from the bytes appended to its logs."""

    def __init__(self, path: Path):
        self.path, self.name = path, path.name
        self.steps: list[int] = []
        self.rewards: list[float] = []
        self.times: list[float] = []    # when each step ended (NaN where the log has no time)
        self.first_time: float | None = None  # the run's first telemetry record: its wall-time origin
        self.resumed = False
        self.cuts = 0          # times logged steps were replaced (a resume): overlaid lines redraw
        self._offsets = {name: 0 for name in LOGS}

    def refresh(self) -> None:
        """Read what was appended to the run's logs since the last refresh."""
        for line in self._new_bytes("metrics.jsonl").splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if "reward/mean" not in r and any(k.startswith("eval/") for k in r):
                continue  # an evaluation's line, logged at the step it followed: not a step again
            step = r.get("step")
            while self.steps and self.steps[-1] >= step:  # a resumed run logs the cut steps again
                self.cuts += 1
                self.steps.pop()
                self.rewards.pop()
                self.times.pop()
            self.steps.append(step)
            reward = r.get("reward/mean")
            self.rewards.append(float("nan") if reward is None else reward)
            self.times.append(r.get("time", float("nan")))
        telemetry = self._new_bytes("telemetry.jsonl")  # searched whole, not split: mostly device samples
        head = telemetry.lstrip()  # a blank first line is skipped, as everywhere
        if head and self.first_time is None:
            self.first_time = json.loads(head[:head.index(b"\n")]).get("time")
        if b'"kind": "resume"' in telemetry:
            self.resumed = True

    def walls(self, start: int = 0) -> list[float]:
        """Return the seconds from the run's start to the end of each step from index ``start``."""
        origin = self.first_time if self.first_time is not None else (self.times[0] if self.times else 0.0)
        return [t - origin for t in self.times[start:]]

    def _new_bytes(self, name: str) -> bytes:
        """Return the complete lines appended to log ``name`` since the last read, as one bytes object."""
        path = self.path / name
        if path.is_file() and path.stat().st_size < self._offsets[name]:  # cut back by a resume: read it again
            self._offsets[name] = 0
            if name == "metrics.jsonl":
                self.steps, self.rewards, self.times, self.cuts = [], [], [], self.cuts + 1
        data, self._offsets[name] = read_complete_lines(path, self._offsets[name])
        return data

    @property
    def status(self) -> str:
        """Return live, finished, failed or crashed, with ``, resumed`` when it was resumed."""
        summary = self.path / "summary.json"
        if summary.is_file():
            try:
                state = "failed" if json.loads(summary.read_text()).get("failed") else "finished"
            except ValueError:
                state = "crashed"  # a summary cut off mid-write
        else:
            written = max(((self.path / n).stat().st_mtime for n in LOGS if (self.path / n).is_file()), default=0)
            state = "live" if time.time() - written < LIVE_S else "crashed"
        return state + (", resumed" if self.resumed else "")

    def row(self) -> dict:
        """Return the run's table row: name, status, last step, last mean reward."""
        last = self.rewards[-1] if self.rewards else float("nan")
        return {"run": self.name, "status": self.status, "step": self.steps[-1] if self.steps else 0,
                "reward": last}


def find_runs(root: str | Path) -> list[Path]:
    """Return the run directories under ``root`` (itself excluded), newest first."""
    root = Path(root)
    found = {p.parent for pattern in ("*/", "*/*/") for name in LOGS for p in root.glob(pattern + name)}
    return sorted(found, key=lambda p: max((p / n).stat().st_mtime for n in LOGS if (p / n).is_file()),
                  reverse=True)


class RunsPage:
    """The table of runs and the overlay of the selected runs' reward curves."""

    def __init__(self, root: str | Path):
        import panel as pn
        from bokeh.plotting import figure

        self.root, self.runs = Path(root), {}
        self.table = pn.pane.HTML("", name="runs", sizing_mode="stretch_width")
        self.select = pn.widgets.MultiSelect(label="overlay the curves of", options=[], size=8, width=360)
        self.select.param.watch(lambda _event: self.draw(), "value")
        self.fig = figure(title="mean reward per step", x_axis_label="step", height=320,
                          sizing_mode="stretch_width")
        self.overlay = Overlay(self.fig)
        self.layout = pn.Column(pn.pane.Markdown(f"## Runs under {self.root}"), self.table,
                                pn.Row(self.select, self.fig, sizing_mode="stretch_width"), sizing_mode="stretch_width")

    def update(self) -> None:
        """Find new runs, read what their logs gained, redraw the table and the selected curves."""
        import html

        for path in find_runs(self.root):
            key = str(path.relative_to(self.root))
            if key not in self.runs:
                self.runs[key] = RunInfo(path)
            self.runs[key].refresh()
        rows = []
        for key, info in self.runs.items():
            r = info.row()
            color = {"live": "#2e7d32", "crashed": "#c62828", "failed": "#c62828"}.get(r["status"].split(",")[0], "")
            reward = "n/a" if r["reward"] != r["reward"] else f"{r['reward']:.3f}"
            rows.append(f"<tr><td>{html.escape(key)}</td><td style='color:{color}'>{r['status']}</td>"
                        f"<td>{r['step']}</td><td>{reward}</td></tr>")
        self.table.object = ("<table><tr><th>run</th><th>status</th><th>last step</th><th>mean reward</th></tr>"
                             + "".join(rows) + "</table>") if rows else f"<p>no runs under {html.escape(str(self.root))} yet</p>"
        if list(self.select.options) != list(self.runs):
            self.select.options = list(self.runs)
        self.draw()

    def draw(self) -> None:
        """Overlay the selected runs' reward curves (see ``Overlay.draw``)."""
        self.overlay.draw(self.runs, list(self.select.value))


class Overlay:
    """The reward curves of other runs on a figure: one line per selected run, kept current."""

    def __init__(self, fig, dash: str = "solid"):
        self.fig, self.dash = fig, dash
        self.lines: dict[str, tuple] = {}   # run -> (renderer, points shown, its cuts when drawn)
        self.x = "step"                     # or "wall" (``axes.StepAxis`` switches it)

    def draw(self, runs: dict[str, RunInfo], selected: list[str]) -> None:
        """Keep one line per selected run: add the newly selected, drop the others, and stream
        each line's new points (a run cut back by a resume is redrawn)."""
        from bokeh.models import ColumnDataSource
        from bokeh.palettes import Category10_10

        for key in [k for k in self.lines if k not in selected]:
            renderer = self.lines.pop(key)[0]
            self.fig.renderers = [r for r in self.fig.renderers if r is not renderer]
            self.fig.legend.items = [item for item in self.fig.legend.items if renderer not in item.renderers]
        for key in selected:
            info = runs[key]
            if key not in self.lines:
                source = ColumnDataSource({"step": [], "reward": [], "wall": []})
                renderer = self.fig.line(self.x, "reward", source=source, legend_label=key, line_dash=self.dash,
                                         color=Category10_10[list(runs).index(key) % 10])
                renderer.tags = [OVERLAY_TAG]  # (a ``tags`` argument would tag the glyph)
                self.lines[key] = (renderer, 0, info.cuts)
            renderer, shown, cuts = self.lines[key]
            source = renderer.data_source
            if cuts != info.cuts:
                source.data, shown = {"step": [], "reward": [], "wall": []}, 0
            if len(info.steps) > shown:
                source.stream({"step": info.steps[shown:], "reward": info.rewards[shown:],
                               "wall": info.walls(shown)}, rollover=ROLLOVER)
            self.lines[key] = (renderer, len(info.steps), info.cuts)


def build_runs_page(root: str | Path, template: bool = False):
    """Return the runs page of ``root`` with its refresh loop attached (every 2 s): served, a
    Panel template page (the run selector in the sidebar, as on a run's page), else a column."""
    import panel as pn

    page = RunsPage(root)
    page.update()
    page.callback = pn.state.add_periodic_callback(page.update, period=REFRESH_MS)
    layout = page.layout
    if template:
        layout = pn.template.BootstrapTemplate(title=f"hybridlab · runs under {page.root.name}", sidebar=[page.select],
                                               main=[page.table, page.fig], sidebar_width=380,
                                               header_background="#2f4f6f")
    layout.runs_page = page
    return layout
