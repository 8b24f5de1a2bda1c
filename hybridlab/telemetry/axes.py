"""The dashboard's x axes: step or wall time for every per-step curve, and hover values.

The per-step plots draw from data sources keyed by ``step``. Rather than keep a second copy of
every source in seconds, a Bokeh ``CustomJSTransform`` maps each step to its wall time in the
browser, through one small step -> seconds table streamed by the dashboard; switching the axis
swaps the renderers' ``x`` between the plain field and the transformed one, and renames the
axis. Curves of other runs (overlays) carry their own ``wall`` column. Markers placed at a step
(remaps, resumes, restarts) show on the step axis only.
"""
from __future__ import annotations

STEP, WALL = "step", "wall time"
AXIS_LABELS = {STEP: "step", WALL: "wall time since the run started (s)"}
OVERLAY_TAG = "overlay"

# steps -> seconds by lookup in the streamed table; a step it does not hold yet maps to NaN
TO_WALL = """
const index = new Map();
const steps = lookup.data.step, wall = lookup.data.wall;
for (let i = 0; i < steps.length; i++) index.set(steps[i], wall[i]);
return xs.map((s) => (index.has(s) ? index.get(s) : NaN));
"""


class StepAxis:
    """The step -> wall-time table of the run, and the switch between the two axes."""

    def __init__(self):
        from bokeh.models import ColumnDataSource, CustomJSTransform

        self.times = ColumnDataSource({"step": [], "wall": []})
        self.transform = CustomJSTransform(args={"lookup": self.times}, v_func=TO_WALL)
        self.mode = STEP

    def add(self, steps: list[int], walls: list[float]) -> None:
        """Stream the wall times (seconds since the run started) at which ``steps`` ended."""
        self.times.stream({"step": steps, "wall": walls}, rollover=100_000)

    def cut(self, last_step: int) -> None:
        """Forget the steps after ``last_step`` (a roll-back will run them again)."""
        keep = [i for i, s in enumerate(self.times.data["step"]) if s <= last_step]
        self.times.data = {k: [v[i] for i in keep] for k, v in self.times.data.items()}

    def apply(self, figures: list, mode: str) -> None:
        """Draw every renderer of ``figures`` against ``mode`` (``STEP`` or ``WALL``)."""
        from bokeh.core.property.vectorization import Field
        from bokeh.models import GlyphRenderer, Span

        if mode not in AXIS_LABELS:
            raise ValueError(f"x axis {mode!r}: one of {', '.join(AXIS_LABELS)}")
        self.mode = mode
        for fig in figures:
            for renderer in fig.renderers:
                if not isinstance(renderer, GlyphRenderer) or not hasattr(renderer.glyph, "x"):
                    continue
                if OVERLAY_TAG in renderer.tags:
                    renderer.glyph.x = Field("step" if mode == STEP else "wall")
                elif field_name(renderer.glyph.x) == "step":
                    renderer.glyph.x = Field("step") if mode == STEP else Field("step", transform=self.transform)
            fig.xaxis.axis_label = AXIS_LABELS[mode]
            for marker in fig.center:
                if isinstance(marker, Span) and marker.dimension == "height":
                    marker.visible = mode == STEP


def field_name(spec) -> str | None:
    """Return the data column a glyph property reads, or None for a fixed value."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, dict):
        return spec.get("field")
    return getattr(spec, "field", None)


def add_hover(fig) -> None:
    """Give ``fig`` a hover tool that names the series under the mouse and its x and y (once)."""
    from bokeh.models import HoverTool

    if any(isinstance(tool, HoverTool) for tool in fig.tools):
        return
    fig.add_tools(HoverTool(tooltips=[("series", "$name"), ("x", "$x{0,0.[00]}"), ("y", "$y{0,0.[000]}")]))


def legend_beside(fig) -> None:
    """Move ``fig``'s legend out of the plot area to its right (once): drawn inside, a legend
    hides what lies under it, the first steps' bars and curves of a page opened on a history."""
    for legend in [x for x in fig.center if x.__class__.__name__ == "Legend"]:
        fig.center.remove(legend)
        legend.location = "top_left"
        fig.add_layout(legend, "right")


def name_series(fig) -> None:
    """Name each renderer after its legend entry (what the hover tool shows as the series)."""
    legend = fig.legend[0] if fig.legend else None
    for item in legend.items if legend is not None else []:
        label = item.label.get("value") if isinstance(item.label, dict) else getattr(item.label, "value", None)
        for renderer in item.renderers:
            if label and renderer.name != label:
                renderer.name = str(label)
