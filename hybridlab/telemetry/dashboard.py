"""The live dashboard of a run: Panel + Bokeh, fed by the telemetry hub or its file.

``build_dashboard(run_dir)`` returns the dashboard: served, a Panel template page whose header
is the status line (run, the phase: warm start with its held-out accuracy, RL step and mean
reward, or evaluation; paused; the processor), whose sidebar holds the display settings and the
run controls, and whose sections (``page.py``) hold the plots; in a notebook, the same in one
column. ``Dashboard`` turns records into streamed points: reward and accuracy curves (smoothed,
other runs overlaid), the phase timeline, device heat maps, weight sync, and the panels of
``panels.py`` and its siblings, each fed the record kinds it reads.
A periodic callback on the server's own loop polls for new records every second and streams
only the new points (Bokeh models may only change on the document's loop). In the process
that runs the session it reads the live hub; elsewhere (``hybridlab dashboard``, ``panel
serve``) it follows the hub's append-only ``telemetry.jsonl``, which also replays finished runs.
"""
from __future__ import annotations

from pathlib import Path

from hybridlab.telemetry import page
from hybridlab.telemetry.advice_panel import AdvicePanel
from hybridlab.telemetry.agent_panel import AgentPanel
from hybridlab.telemetry.axes import AXIS_LABELS, STEP, WALL, StepAxis, add_hover, legend_beside, name_series
from hybridlab.telemetry.controls import RunControls
from hybridlab.telemetry.heatmap import HeatMap
from hybridlab.telemetry.mapping_view import mapping_html, mapping_text, remap_table
from hybridlab.telemetry.moe_panel import MoEPanel
from hybridlab.telemetry.stream_panel import StreamPanel
from hybridlab.telemetry.panels import (BusyPanel, MemoryPanel, MismatchPanel, ReshardPanel, RolloutPanel,
                                       RunningPanel, ema)
from hybridlab.telemetry.record_source import RecordSource
from hybridlab.telemetry.runs import Overlay, RunInfo, find_runs
from hybridlab.telemetry.service_panel import ServicePanel
from hybridlab.telemetry.training_panel import TrainingPanel

STAGE_COLORS = {"generate": "#4e79a7", "reward": "#f28e2b", "reward_model": "#f28e2b", "remax_baseline": "#edc948",
                "old_logprob": "#59a14f", "rollout_as_old_logprob": "#59a14f", "ref_logprob": "#76b7b2",
                "values": "#b07aa1", "update_critic": "#ff9da7", "update_actor": "#e15759",
                "sync_weights": "#9c755f", "filter_groups": "#bab0ac", "evaluate": "#79706e"}
GANTT_SPANS = 600          # spans kept in the timeline (about the last few steps)
STUCK, STUCK_ALARM = page.STUCK, "⚠ Stuck calls: a call is late"  # the tab, and its title when alarmed
ROLLOVER = {"curves": 100_000, "evals": 10_000, "sync": 100_000}  # points kept per source
POLL_MS = 1000
HOLD_HISTORY_POLLS = 10    # a served page that never reports being drawn gets its device history after 10 s
OVERLAY_POLLS = 5          # the runs beside this one are listed, and the overlaid ones read, every 5th poll


class Dashboard:
    """The plots and the state that turns records into streamed points; ``page.py`` lays them out."""

    def __init__(self, run_dir: str | Path, control: bool = True):
        """``control``: offer the run controls (localhost, or a logged-in user elsewhere)."""
        import panel as pn
        from bokeh.models import ColumnDataSource

        self.run_dir = Path(run_dir)
        self.info = RunInfo(self.run_dir)  # live, finished, failed or crashed (from the run directory)
        self.source = RecordSource(run_dir)
        self.run_name, self.step, self.reward = Path(run_dir).name, 0, float("nan")
        self.phase: dict = {}  # the latest "phase" record: warm start, evaluate (RL steps: metrics)
        self.processor = ""
        self.backends: dict[str, str] = {}   # training role -> backend (megatron, fsdp2)
        self.t0: float | None = None
        self.polls = 0
        self.restarts: list[dict] = []   # dead or stuck workers re-created
        self.remaps: list[dict] = []
        self.resumes: list[dict] = []
        self.controls = RunControls(run_dir) if control else None
        self.status = pn.pane.Markdown(self._status_text(), name="status")
        self.mapping_pane = pn.pane.Markdown("", name="mapping")  # the current device mapping
        self.mapping_drawing = pn.pane.HTML("", name="mapping drawing", sizing_mode="stretch_width")
        self.remap_table = pn.pane.HTML("<p>no remap yet</p>", name="remaps", sizing_mode="stretch_width")
        self.curves = ColumnDataSource({"step": [], "reward": [], "accuracy": [], "reward_smooth": [],
                                        "accuracy_smooth": []})
        self.smoothing = pn.widgets.FloatSlider(label="smoothing (exponential, as TensorBoard's)", start=0.0,
                                                end=0.99, step=0.01, value=0.6, width=240)
        self.smoothing.param.watch(lambda _: self._resmooth(), "value")
        self._ema: dict[str, tuple] = {"reward": (0.0, 0), "accuracy": (0.0, 0)}
        self.axis = StepAxis()
        self.x_axis = pn.widgets.RadioButtonGroup(label="x axis", options=[STEP, WALL], value=STEP, width=240)
        self.x_axis.param.watch(lambda event: self._switch_axis(event.new), "value")
        self.evals = ColumnDataSource({"step": [], "accuracy": []})
        self.spans = ColumnDataSource({"worker": [], "left": [], "right": [], "stage": [], "color": []})
        self.sync = ColumnDataSource({"step": [], "mb": [], "seconds": []})

        common = dict(height=260, sizing_mode="stretch_width", toolbar_location="above")
        self._reward_figure(common)
        self.others: dict[str, RunInfo] = {}   # the runs beside this one, to overlay
        self.overlay = Overlay(self.reward_fig, dash="dashed")
        self.compare = pn.widgets.MultiSelect(label="overlay the reward of", options=[], size=6, width=240)
        self.compare.param.watch(lambda _: self._draw_overlay(), "value")
        self._system_figures(common)
        self.running = RunningPanel()
        self.memory = MemoryPanel(self._clock)
        self.memory.fig.x_range = self.gantt_fig.x_range  # the phases above are the memory's phase markers
        self.busy, self.rollout, self.reshard = BusyPanel(), RolloutPanel(), ReshardPanel()
        self.mismatch, self.agent, self.moe, self.stream = MismatchPanel(), AgentPanel(), MoEPanel(), StreamPanel()
        self.training, self.advice, self.service = TrainingPanel(), AdvicePanel(run_dir, control), ServicePanel()
        self.panels = [self.running, self.memory, self.busy, self.rollout, self.reshard, self.mismatch, self.agent,
                       self.moe, self.stream, self.training, self.advice, self.service] + ([self.controls] if self.controls else [])
        self.explanation = pn.pane.Markdown("", name="explanation", sizing_mode="stretch_width")
        self.sections = page.sections(self)
        # dynamic: the browser builds a section when it is opened, so the first render draws the Overview only
        self.tabs = pn.Tabs(*self.sections.items(), dynamic=True, sizing_mode="stretch_width")
        for fig in self.figures():
            add_hover(fig)

    def _reward_figure(self, common: dict) -> None:
        """Make the reward and accuracy plot: each step faint, smoothed solid, evaluations as dots."""
        from bokeh.plotting import figure

        self.reward_fig = figure(title="reward and accuracy per step (solid: smoothed; dashed: other runs)",
                                 x_axis_label="step", **common)
        for column, label, color in (("reward", "mean reward", "#4e79a7"), ("accuracy", "sample accuracy", "#59a14f")):
            self.reward_fig.line("step", column, source=self.curves, color=color, alpha=0.25, legend_label=label)
            self.reward_fig.line("step", f"{column}_smooth", source=self.curves, color=color, legend_label=label)
        self.reward_fig.scatter("step", "accuracy", source=self.evals, legend_label="greedy test accuracy",
                                color="#e15759", size=7)
        self.reward_fig.legend.location = "top_left"

    def _system_figures(self, common: dict) -> None:
        """Make the worker-phase, device-utilization and weight-sync figures."""
        from bokeh.models import FactorRange
        from bokeh.plotting import figure

        self.gantt_fig = figure(title="worker phases (last steps)", y_range=FactorRange(), x_axis_label="seconds",
                                **common)
        self.gantt_fig.hbar(y="worker", left="left", right="right", height=0.7, color="color", legend_field="stage",
                            source=self.spans)
        self.gantt_fig.legend.location = "top_left"
        self.devices = HeatMap("device utilization (%: CPU per worker process; GPU with NVML), mean per time bin",
                               "seconds since the run started", "utilization %", bin_width=5.0, high=100.0)
        self.sync_fig = figure(title="weight sync per step: MB (bars) and seconds (line, x100)",
                               x_axis_label="step", **common)
        self.sync_fig.vbar(x="step", top="mb", width=0.8, source=self.sync, color="#9c755f")
        self.sync_fig.line(x="step", y="seconds", source=self.sync, color="#000000")

    def figures(self) -> list:
        """Return every Bokeh figure of the page's line and bar plots (heat maps have their own hover)."""
        import panel as pn

        heat = {id(self.devices.fig), id(self.busy.fig), id(self.memory.heat.fig)}
        return [pane.object for pane in self.tabs.select(pn.pane.Bokeh) if id(pane.object) not in heat]

    def step_figures(self) -> list:
        """Return the figures whose x axis is the step (the ones the x-axis switch redraws)."""
        return [fig for fig in self.figures() if fig.xaxis[0].axis_label in AXIS_LABELS.values()]

    def _switch_axis(self, mode: str) -> None:
        """Draw every per-step curve, other runs' too, against ``mode`` (step or wall time)."""
        self.overlay.x = "step" if mode == STEP else "wall"
        self.axis.apply(self.step_figures(), mode)

    def _resmooth(self) -> None:
        """Smooth the curves anew (the smoothing changed, or a roll-back cut them)."""
        data = dict(self.curves.data)
        for column in ("reward", "accuracy"):
            data[f"{column}_smooth"], self._ema[column] = ema(list(data[column]), self.smoothing.value)
        self.curves.data = data

    def stop(self) -> None:
        """Stop polling (a notebook's dashboard has no server session that would end it)."""
        callback = getattr(self, "callback", None)
        if callback is not None:
            callback.stop()

    def _status_text(self) -> str:
        """The status line: run, what it is doing now (warm start, RL step, evaluation), reward."""
        reward = "n/a" if self.reward != self.reward else f"{self.reward:.3f}"
        phase = self.phase.get("phase")
        if phase == "warm start":
            acc = self.phase.get("accuracy")
            held = "" if acc is None else \
                f" · held-out accuracy {acc:.1%} of target {self.phase.get('target', float('nan')):.0%}"
            doing = f"warm start step {self.phase.get('step', 0)}/{self.phase.get('max_steps', '?')}{held}"
        elif phase == "evaluate":
            doing = f"evaluating after RL step {self.phase.get('step', self.step)}"
        else:
            doing = f"RL step {self.step} · mean reward {reward}"
        where = f" · {self.processor}" if self.processor else ""
        if self.backends:
            where += " · " + ", ".join(f"{role} on {b}" for role, b in self.backends.items())
        restarts = f" · {len(self.restarts)} worker restart(s), last: {self.restarts[-1]['role']}" \
            f" {self.restarts[-1]['failure']}" if self.restarts else ""
        state = " · **paused**" if self.controls is not None and self.controls.paused else ""
        state += " · reading the history's device samples" if self.source.loading else ""
        resumed = ", resumed" if self.resumes else ""
        return f"run {self.run_name} · {doing}{state}{where}{restarts} · {self.info.status.split(',')[0]}{resumed}"

    def _clock(self, t: float) -> float:
        """Return seconds since the run's first record (the run's start for a page that saw it)."""
        if self.t0 is None and t == t:
            self.t0 = t
        return t - self.t0 if self.t0 is not None else float("nan")

    def update(self) -> None:
        """Poll the source and stream the new points (call on the document's loop)."""
        records = self.source.poll()
        self.polls += 1
        if self.polls % OVERLAY_POLLS == 1:
            self._refresh_others()
        if not records:
            self.running.feed([])  # the ages of the calls in flight still grow
            self.status.object = self._status_text()  # live, finished, crashed
            self._alarm()
            return
        curves, evals, spans, sync = ([] for _ in range(4))
        devices: tuple[list, list, list] = ([], [], [])  # device label, seconds, utilization
        for r in records:
            kind = r.get("kind")
            if kind == "device":  # most records: first
                devices[0].append(f"{r['device']} {r['role']} r{r['rank']}")
                devices[1].append(self._clock(r["time"]))
                devices[2].append(r["util"])
            elif kind == "run":
                self._clock(r.get("time", float("nan")))  # the run's start: the origin of every seconds axis
                self.run_name = r.get("name", self.run_name)
                self.processor = r.get("processor", "")
                self.backends = r.get("backends") or {}
                self.mapping_pane.object = mapping_text(r.get("mapping") or {})
                self.mapping_drawing.object = mapping_html(r.get("mapping") or {})
                self.explanation.object = r.get("explanation", "")
            elif kind == "remap":
                self._mark_remap(r)
            elif kind == "resume":  # the run went on from a checkpoint: later records replace the lost ones
                self._mark_resume(r)
            elif kind == "restart":
                self._mark_restart(r, [curves, evals, sync])
            elif kind == "phase":
                self.phase = r
            elif kind == "metrics":
                self.step, self.reward, self.phase = r["step"], r.get("reward/mean", float("nan")), {}
                curves.append(r)
            elif kind == "eval":
                self.phase = {}
                evals.append(r)
            elif kind == "span":
                spans.append(r)
            elif kind == "sync":
                sync.append(r)
        self._stream(curves, evals, spans, sync)
        streamed = {id(r) for r in curves + sync}
        by_kind: dict[str, list[dict]] = {}
        for r in records:  # rolled-back steps (dropped from curves and sync above) stay out
            if r.get("kind") not in ("metrics", "sync") or id(r) in streamed:
                by_kind.setdefault(r.get("kind"), []).append(r)
        for panel in self.panels:
            panel.feed([r for kind in panel.kinds for r in by_kind.get(kind, [])])
        if devices[0]:
            self.devices.add(*devices)
        self._finish_poll()

    def _finish_poll(self) -> None:
        """Send the heat map's new cells, name new series, keep new lines on the chosen x axis,
        and refresh the status and the Stuck calls alarm."""
        self.devices.flush()
        for fig in self.figures():  # the hover tool names each series (plots built at their first step too)
            add_hover(fig)
            name_series(fig)
            legend_beside(fig)
        if self.axis.mode == WALL:  # lines and step markers added since the switch follow it too
            self.axis.apply(self.step_figures(), WALL)
        self.status.object = self._status_text()
        self._alarm()

    def _stream(self, curves: list[dict], evals: list[dict], spans: list[dict], sync: list[dict]) -> None:
        """Stream one poll's steps, evaluations, phase spans and syncs to their plots."""
        if curves:
            new = {"reward": [r.get("reward/mean", float("nan")) for r in curves],
                   "accuracy": [r.get("accuracy", float("nan")) for r in curves]}
            for column in ("reward", "accuracy"):
                new[f"{column}_smooth"], self._ema[column] = ema(new[column], self.smoothing.value, self._ema[column])
            # the step -> seconds table first: the browser maps the new points through it as they arrive
            self.axis.add([r["step"] for r in curves], [self._clock(r.get("time", float("nan"))) for r in curves])
            self.curves.stream({"step": [r["step"] for r in curves], **new}, rollover=ROLLOVER["curves"])
        if evals:
            self.evals.stream({"step": [r["step"] for r in evals], "accuracy": [r["accuracy"] for r in evals]},
                              rollover=ROLLOVER["evals"])
        if spans:
            self._stream_spans(spans)
        if sync:
            self.sync.stream({"step": [r["step"] for r in sync], "mb": [r["bytes"] / 2**20 for r in sync],
                              "seconds": [100 * r["seconds"] for r in sync]}, rollover=ROLLOVER["sync"])

    def _refresh_others(self) -> None:
        """Find the runs beside this one (its folder's other runs), read what their logs gained
        and keep their overlaid curves current."""
        parent = self.run_dir.resolve().parent
        for path in find_runs(parent)[:50]:
            key = path.name if path.parent == parent else str(path.relative_to(parent))
            if path.resolve() != self.run_dir.resolve():
                self.others.setdefault(key, RunInfo(path))
        if list(self.compare.options) != list(self.others):
            self.compare.options = list(self.others)
        self._draw_overlay()

    def _draw_overlay(self) -> None:
        """Read the overlaid runs' new log lines and draw them (only those: a folder of long runs
        would otherwise be read whole before the first page)."""
        chosen = list(self.compare.value)
        for key in chosen:
            self.others[key].refresh()
        self.overlay.draw(self.others, chosen)

    def _alarm(self) -> None:
        """Title the Stuck calls tab as alarmed while a call is past its deadline (and back)."""
        import panel as pn

        title, index = STUCK_ALARM if self.running.late() else STUCK, list(self.sections).index(STUCK)
        if self.tabs._names[index] != title:
            # a new wrapper: Panel keeps a tab's old title while the tab holds the same object
            self.tabs[index] = (title, pn.Column(self.sections[STUCK], sizing_mode="stretch_width"))

    def _mark_remap(self, r: dict) -> None:
        """Show the new mapping and mark the remap on the curves (a dashed line at its step)."""
        from bokeh.models import Span

        self.remaps.append(r)
        roles = ", ".join(r.get("roles_recreated", [])) or "none"
        step, seconds = r.get("step", self.step), (r.get("seconds") or {}).get("total", 0.0)
        before = mapping_text(r.get("mapping_before") or {}).replace("mapping: ", "", 1)
        self.mapping_pane.object = (mapping_text(r.get("mapping_after") or {}) + f"  \n*remapped after step {step}:"
                                    f" re-created {roles} in {seconds:.1f} s; before: {before}*")
        self.mapping_drawing.object = mapping_html(r.get("mapping_after") or {})
        self.remap_table.object = remap_table(self.remaps)
        self.reward_fig.add_layout(Span(location=step + 0.5, dimension="height", line_dash="dashed",
                                        line_color="#555555", line_width=1))
        if "time" in r:  # and on the phase timeline, at the moment it finished
            self.gantt_fig.add_layout(Span(location=self._clock(r["time"]), dimension="height", line_dash="dashed",
                                           line_color="#555555", line_width=2))

    def _mark_resume(self, r: dict) -> None:
        """Mark a resume from a checkpoint on the reward curve (a dotted green line at its step)."""
        from bokeh.models import Span

        self.resumes.append(r)
        self.reward_fig.add_layout(Span(location=r.get("step", self.step) + 0.5, dimension="height",
                                        line_dash="dotted", line_color="#2e7d32", line_width=2))

    def _mark_restart(self, r: dict, unstreamed: list[list[dict]]) -> None:
        """Mark a worker restart on the reward curve (a red dash-dot line); after a roll-back to a
        checkpoint, drop the points of the steps that will be run again (streamed ones and the
        ``unstreamed`` records of this poll)."""
        from bokeh.models import Span

        self.restarts.append(r)
        back = r.get("rolled_back_to")
        if back is not None:
            for records in unstreamed:
                records[:] = [x for x in records if x["step"] <= back]
            self.busy.heat.cut(back)
            self.axis.cut(back)
            for source in (self.curves, self.evals, self.sync, self.rollout.source, self.mismatch.source,
                           self.agent.source, *self.agent.tools.values(), self.moe.source, self.stream.source):
                keep = [i for i, step in enumerate(source.data["step"]) if step <= back]
                source.data = {k: [v[i] for i in keep] for k, v in source.data.items()}
            self._resmooth()  # the smoothing state continues from the kept steps
        self.reward_fig.add_layout(Span(location=r.get("step", self.step) + 0.5, dimension="height",
                                        line_dash="dashdot", line_color="#c62828", line_width=2))

    def _stream_spans(self, spans: list[dict]) -> None:
        workers = [f"{s['role']} {s['rank']}" for s in spans]
        known = list(self.gantt_fig.y_range.factors)
        new = sorted(set(workers) - set(known))
        if new:
            self.gantt_fig.y_range.factors = sorted(known + new)
        self.spans.stream({"worker": workers, "left": [self._clock(s["start"]) for s in spans],
                           "right": [self._clock(s["end"]) for s in spans],
                           "stage": [s.get("stage") or s["method"] for s in spans],
                           "color": [STAGE_COLORS.get(s.get("stage") or "", "#bab0ac") for s in spans]},
                          rollover=GANTT_SPANS)


def build_dashboard(run_dir: str | Path, control: bool = True, template: bool = False):
    """Return the dashboard of ``run_dir`` with its 1 s update loop attached: a Panel template
    page (header, sidebar, sections) with ``template``, else a column for a notebook cell. With
    ``control`` it offers the run controls (pause, resume, stop, stacks)."""
    import panel as pn

    board = Dashboard(run_dir, control)
    board.update()  # a late viewer sees the whole history at once
    if template and board.source.loading:  # served: parse the device samples once the browser drew the page
        board.source.hold_polls = HOLD_HISTORY_POLLS
        pn.state.onload(board.source.release_history)
    board.callback = pn.state.add_periodic_callback(board.update, period=POLL_MS)
    layout = page.template_page(board) if template else page.inline(board)
    layout.dashboard = board  # keep the state reachable (tests, the session's shutdown)
    return layout
