"""MappingEditor: the device mapping of a running session as an editable table, a drawing of
which devices each role occupies, Suggest (the mapping advisor's best mapping, put in the
table with its prediction), and Validate / Apply through ``rl.remap``."""
from __future__ import annotations

import html
from typing import TYPE_CHECKING

import ipywidgets as widgets

from hybridlab.controller.mapping import ROLES, DeviceMapping
from hybridlab.controller.mapping_drawing import draw
from hybridlab.errors import UserError
from hybridlab.notebook.apply import FOREGROUND_NOTE, Applier, ok, problem_list, problems_of

if TYPE_CHECKING:
    from hybridlab.dataflow.session_verbs import SessionVerbs

SMALL = widgets.Layout(width="70px")


class _PoolRow:
    def __init__(self, name: str, devices: int, settings: dict | None = None):
        self.settings = dict(settings or {})  # strategy, cpus_per_device, node_labels: kept as they were
        self.name = widgets.Text(value=name, layout=widgets.Layout(width="120px"))
        self.devices = widgets.BoundedIntText(value=devices, min=0, max=4096, layout=SMALL)
        self.box = widgets.HBox([self.name, self.devices])


class _RoleRow:
    def __init__(self, role: str, layout, pools: list[str]):
        self.role = role
        self.on = widgets.Checkbox(value=layout is not None, description=role, indent=False,
                                   layout=widgets.Layout(width="90px"))
        self.pool = widgets.Combobox(value=layout.pool if layout else (pools[0] if pools else ""), options=pools,
                                     placeholder=f"{role} pool", layout=widgets.Layout(width="120px"))
        self.tp, self.pp, self.dp, self.ep = (
            widgets.BoundedIntText(value=getattr(layout, k) if layout else 1, min=1, max=4096, layout=SMALL)
            for k in ("tp", "pp", "dp", "ep"))
        self.colocate = widgets.Text(value=(layout.colocate or "") if layout else "", placeholder=f"{role} group",
                                     layout=widgets.Layout(width="120px"))
        self.box = widgets.HBox([self.on, self.pool, self.tp, self.pp, self.dp, self.ep, self.colocate])

    def as_dict(self) -> dict:
        out = {"pool": self.pool.value.strip(), "tp": self.tp.value, "pp": self.pp.value, "dp": self.dp.value}
        if self.ep.value > 1:  # expert parallelism (MoE training roles); 1 is left out, as to_dict does
            out["ep"] = self.ep.value
        if self.colocate.value.strip():
            out["colocate"] = self.colocate.value.strip()
        return out


class MappingEditor(widgets.VBox):
    """Edit pools (name, devices) and roles (pool, tp, pp, dp, ep, colocation group); the drawing
    follows every change; **Suggest** fills in the advisor's best mapping; **Validate** lists the
    problems; **Apply** remaps the session."""

    def __init__(self, rl: "SessionVerbs"):
        self.rl = rl
        current = rl.mapping
        self.pool_rows = [_PoolRow(n, p.devices, {k: v for k, v in (("strategy", p.strategy),
                                                                      ("cpus_per_device", p.cpus_per_device),
                                                                      ("node_labels", p.node_labels)) if v is not None})
                          for n, p in current.pools.items()]
        self.role_rows = [_RoleRow(r, current.roles.get(r), list(current.pools)) for r in ROLES]
        self.pools_box = widgets.VBox([widgets.HTML("<b>pools</b>: name, devices (0 removes a pool)")] + [r.box for r in self.pool_rows])
        add_pool = widgets.Button(description="add pool", icon="plus")
        add_pool.on_click(lambda _: self.add_pool())
        header = widgets.HTML("<b>roles</b> (the same colocation group: the same processes)")
        columns = widgets.HBox([widgets.HTML(f"<small><b>{text}</b></small>", layout=widgets.Layout(width=width))
                                for text, width in (("role", "94px"), ("pool", "124px"), ("tp", "74px"),
                                                    ("pp", "74px"), ("dp", "74px"), ("ep", "74px"),
                                                    ("colocation group", "124px"))])
        self.drawing = widgets.HTML()
        self.status = widgets.HTML()
        self.validate_button = widgets.Button(description="Validate", icon="check")
        self.apply_button = widgets.Button(description="Apply", button_style="primary", icon="exchange")
        self.suggest_button = widgets.Button(description="Suggest", icon="lightbulb-o",
                                             tooltip="the mapping advisor's fastest predicted mapping")
        self.suggest_button.on_click(lambda _: self.suggest())
        self.validate_button.on_click(lambda _: self.validate())
        self.apply_button.on_click(lambda _: self.apply())
        self.applier = Applier(rl, self.status)
        for row in self.pool_rows:
            self._watch(row)
        for row in self.role_rows:
            self._watch(row)
        self.redraw()
        super().__init__([self.pools_box, add_pool, header, columns, *[r.box for r in self.role_rows], self.drawing,
                          widgets.HBox([self.suggest_button, self.validate_button, self.apply_button]), self.status,
                          widgets.HTML(f"<small>{html.escape(FOREGROUND_NOTE)}</small>")])

    # ------------------------------------------------------------- editing
    def _watch(self, row) -> None:
        for w in row.box.children:
            w.observe(lambda _: self.redraw(), "value")

    def add_pool(self, name: str | None = None, devices: int = 1) -> None:
        """Add a pool row (named ``pool<N>`` unless given)."""
        taken = {r.name.value for r in self.pool_rows}
        name = name or next(f"pool{i}" for i in range(1, 1000) if f"pool{i}" not in taken)
        row = _PoolRow(name, devices)
        self.pool_rows.append(row)
        self._watch(row)
        self.pools_box.children = (*self.pools_box.children, row.box)
        self.redraw()

    def role(self, name: str) -> _RoleRow:
        """Return the row of role ``name`` (its widgets: on, pool, tp, pp, dp, ep, colocate)."""
        for row in self.role_rows:
            if row.role == name:
                return row
        raise KeyError(f"no role {name!r}; roles: {', '.join(r.role for r in self.role_rows)}")

    def pool(self, name: str) -> _PoolRow:
        """Return the row of pool ``name`` (its widgets: name, devices)."""
        for row in self.pool_rows:
            if row.name.value == name:
                return row
        raise KeyError(f"no pool {name!r}; pools: {', '.join(r.name.value for r in self.pool_rows)}")

    def show(self, mapping: DeviceMapping) -> None:
        """Put ``mapping`` in the table (a pool's other settings kept where its name is kept)."""
        kept = {r.name.value: r.settings for r in self.pool_rows}
        self.pool_rows = [_PoolRow(n, p.devices, kept.get(n)) for n, p in mapping.pools.items()]
        for row in self.pool_rows:
            self._watch(row)
        self.pools_box.children = (self.pools_box.children[0], *[r.box for r in self.pool_rows])
        for row in self.role_rows:
            lay = mapping.roles.get(row.role)
            row.on.value = lay is not None
            if lay is not None:
                row.pool.value, row.colocate.value = lay.pool, lay.colocate or ""
                row.tp.value, row.pp.value, row.dp.value, row.ep.value = lay.tp, lay.pp, lay.dp, lay.ep
        self.redraw()

    def mapping_dict(self) -> dict:
        """Return the mapping the table describes (pools with 0 devices or no name are left out)."""
        pools = {r.name.value.strip(): {**r.settings, "devices": r.devices.value} for r in self.pool_rows
                 if r.name.value.strip() and r.devices.value > 0}
        for row in self.role_rows:
            row.pool.options = list(pools)
        return {"pools": pools, "roles": {r.role: r.as_dict() for r in self.role_rows if r.on.value}}

    # ------------------------------------------------------------- actions
    def problems(self) -> list[str]:
        """Return every reason the table's mapping cannot run in this session (empty: it can)."""
        try:
            self.rl.check_remap(self.mapping_dict())
        except Exception as exc:  # MappingError or ConfigError: their lines are the problems
            return problems_of(exc)
        return []

    def suggest(self, profile=None):
        """Put the mapping advisor's best mapping in the table and show its prediction against the
        current one; returns the Suggestion (None when there is none: the status says why)."""
        try:
            found = self.rl.suggest_mapping(profile)
        except UserError as exc:  # no profile yet, or no mapping can run
            self.status.value = problem_list("No suggestion:", problems_of(exc))
            return None
        self.show(found.best.mapping if not found.same else self.rl.mapping)
        self.status.value = ok(found.text() + ("" if found.same else " Apply remaps the session onto it."))
        return found

    def validate(self) -> list[str]:
        """Show the problems (or that the mapping can run); returns them."""
        found = self.problems()
        self.status.value = problem_list("This mapping cannot run:", found) if found else ok(
            "This mapping can run. Apply moves the session onto it between steps.")
        return found

    def apply(self) -> None:
        """Remap the session onto the table's mapping (at the next step boundary during a
        background run); the status shows the report or the problems."""
        mapping = self.mapping_dict()
        try:
            if DeviceMapping.from_dict(mapping) == self.rl.mapping:
                self.status.value = ok("Nothing to apply: the session already runs this mapping.")
                return
        except Exception:  # not a mapping at all: rl.remap names what is wrong
            pass

        def done(report) -> str:
            self.redraw()
            seconds = report.seconds.get("total", sum(report.seconds.values()))
            return ok(f"Applied after step {report.step}: re-created {', '.join(report.roles_recreated) or 'no roles'}"
                      f"; {report.processes_started} processes started, {report.processes_stopped} stopped;"
                      f" {report.bytes_moved / 2**20:.1f} MB moved in memory; {seconds:.1f} s.")

        self.applier(lambda: self.rl.remap(mapping), done)

    # ------------------------------------------------------------- drawing
    def redraw(self) -> None:
        """Draw each pool's devices with the role ranks on them (or say why it cannot be drawn)."""
        try:
            mapping = DeviceMapping.from_dict(self.mapping_dict())
        except Exception as exc:
            self.drawing.value = problem_list("Cannot draw this mapping:", problems_of(exc))
            return
        self.drawing.value = draw(mapping)
