"""DataflowEditor: the stages of a step switched on and off, the algorithm picked from the
registries, and the hyperparameters that change live; Validate / Apply through ``rl.update``."""
from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING

import ipywidgets as widgets

from hybridlab.notebook.apply import FOREGROUND_NOTE, Applier, ok, problem_list, problems_of

if TYPE_CHECKING:
    from hybridlab.dataflow.session import RLSession

KL_PLACES = ("off", "in reward", "in loss")


def _registries() -> dict[str, list[str]]:
    """The choices, read from the registries each time (a newly registered algorithm appears)."""
    from hybridlab.algos import ADV_ESTIMATORS, AGG_MODES, KL_PENALTIES, POLICY_LOSSES

    return {"algorithm.adv_estimator": sorted(ADV_ESTIMATORS), "actor.policy_loss": sorted(POLICY_LOSSES),
            "actor.loss_agg_mode": list(AGG_MODES), "kl_type": list(KL_PENALTIES)}


class DataflowEditor(widgets.VBox):
    """Stages (on/off, with role, inputs and outputs), algorithm selectors, live hyperparameters."""

    def __init__(self, rl: "RLSession"):
        self.rl = rl
        cfg = rl.cfg
        choices = _registries()
        self.selectors = {key: widgets.Dropdown(options=options, description=key.split(".")[-1], value=_get(cfg, key),
                                                style={"description_width": "120px"})
                          for key, options in choices.items() if key != "kl_type"}
        kl_place = "in loss" if cfg.actor.use_kl_loss else "in reward" if cfg.algorithm.use_kl_in_reward else "off"
        self.kl_place = widgets.ToggleButtons(options=KL_PLACES, value=kl_place, description="KL")
        self.kl_type = widgets.Dropdown(options=choices["kl_type"], description="KL type",
                                        value=cfg.actor.kl_loss_type if kl_place == "in loss" else cfg.algorithm.kl_penalty)
        self.kl_coef = widgets.FloatText(description="KL coef", value=_kl_coef(cfg, kl_place))
        self.numbers = {key: widgets.FloatText(description=key.split(".")[-1], value=_get(cfg, key))
                        for key in ("actor.clip_ratio", "actor.entropy_coeff", "actor.lr", "rollout.temperature")}
        self.default_stages = widgets.Checkbox(value=cfg.dataflow is None, indent=False,
                                               description="the algorithm's default stages")
        self.stages_box = widgets.VBox()
        self.stage_boxes: dict[str, widgets.Checkbox] = {}
        self.default_stages.observe(lambda _: self._enable_stages(), "value")
        self.status = widgets.HTML()
        self.validate_button = widgets.Button(description="Validate", icon="check")
        self.apply_button = widgets.Button(description="Apply", button_style="primary", icon="play")
        self.validate_button.on_click(lambda _: self.validate())
        self.apply_button.on_click(lambda _: self.apply())
        self.applier = Applier(rl, self.status)
        self.refresh_stages()
        super().__init__([
            widgets.HTML("<b>algorithm</b> (choices come from the registries)"), *self.selectors.values(),
            self.kl_place, widgets.HBox([self.kl_type, self.kl_coef]),
            widgets.HTML("<b>hyperparameters</b> (applied to the running workers)"), *self.numbers.values(),
            widgets.HTML("<b>stages</b> of one step (role: inputs &rarr; outputs)"), self.default_stages,
            self.stages_box, widgets.HBox([self.validate_button, self.apply_button]), self.status,
            widgets.HTML(f"<small>{html.escape(FOREGROUND_NOTE)}</small>")])

    # ------------------------------------------------------------- stages
    def refresh_stages(self) -> None:
        """Rebuild the stage list: the session's stages in order (on), then every other
        registered stage (off)."""
        from hybridlab.dataflow.stages import STAGES

        current = self.rl.dataflow.names
        rows = []
        self.stage_boxes = {}
        for name in [*current, *[n for n in STAGES if n not in current]]:
            stage = STAGES[name]
            box = widgets.Checkbox(value=name in current, description=name, indent=False,
                                   layout=widgets.Layout(width="200px"))
            self.stage_boxes[name] = box
            io = f"{stage.role or 'controller'}: {', '.join(stage.inputs(self.rl.cfg))} &rarr; " \
                 f"{', '.join(stage.outputs(self.rl.cfg))}"
            rows.append(widgets.HBox([box, widgets.HTML(f"<small>{io}</small>")]))
        self.stages_box.children = rows
        self._enable_stages()

    def _enable_stages(self) -> None:
        for box in self.stage_boxes.values():
            box.disabled = self.default_stages.value

    # ------------------------------------------------------------ overrides
    def overrides(self) -> list[str]:
        """Return the ``key=value`` changes the widgets make to the session's config."""
        cfg, out = self.rl.cfg, []

        def put(key: str, value) -> None:
            if _get(cfg, key) != value:
                out.append(f"{key}={json.dumps(value)}")

        for key, w in {**self.selectors, **self.numbers}.items():
            put(key, w.value)
        place = self.kl_place.value
        put("actor.use_kl_loss", place == "in loss")
        put("algorithm.use_kl_in_reward", place == "in reward")
        if place == "in loss":
            put("actor.kl_loss_type", self.kl_type.value)
            put("actor.kl_loss_coef", self.kl_coef.value)
        elif place == "in reward":
            put("algorithm.kl_penalty", self.kl_type.value)
            put("algorithm.kl_ctrl.kl_coef", self.kl_coef.value)
        if self.default_stages.value:
            if cfg.dataflow is not None:
                out.append("dataflow=null")
        else:
            chosen = [n for n, box in self.stage_boxes.items() if box.value]
            if chosen != self.rl.dataflow.names:
                out.append(f"dataflow={json.dumps(chosen)}")
        return out

    def validate(self) -> list[str]:
        """Show the problems of the edit (or the stages it would run); returns the problems."""
        from hybridlab.dataflow import remap

        try:
            change = remap.prepare_update(self.rl, tuple(self.overrides()))
        except Exception as exc:  # ConfigError / DataflowError: their lines are the problems
            found = problems_of(exc)
            self.status.value = problem_list("This edit cannot run:", found)
            return found
        self.status.value = ok("This edit can run. Stages: " + " → ".join(change.flow.names))
        return []

    def apply(self) -> None:
        """Apply the edit with ``rl.update`` (at the next step boundary during a background run)."""
        overrides = self.overrides()
        if not overrides:
            self.status.value = ok("Nothing to apply: the widgets match the session.")
            return

        def done(_) -> str:
            self.refresh_stages()
            return ok(f"Applied for step {self.rl.step_count + 1}: {', '.join(overrides)}. Stages: "
                      + " → ".join(self.rl.dataflow.names))

        self.applier(lambda: self.rl.update(*overrides), done)


def _get(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _kl_coef(cfg, place: str) -> float:
    return cfg.actor.kl_loss_coef if place == "in loss" else cfg.algorithm.kl_ctrl.kl_coef
