"""DataflowEditor: the stages of a step switched on and off, the algorithm picked from the
registries, and the hyperparameters that change live; Validate / Apply through ``rl.update``."""
from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING

import ipywidgets as widgets

from hybridlab.algos import ADV_ESTIMATORS, AGG_MODES, KL_PENALTIES, POLICY_LOSSES
from hybridlab.dataflow.stages import STAGES
from hybridlab.notebook.apply import FOREGROUND_NOTE, Applier, ok, problem_list, problems_of

if TYPE_CHECKING:
    from hybridlab.dataflow.session_verbs import SessionVerbs

KL_PLACES = ("off", "in reward", "in loss")


def _registries() -> dict[str, list[str]]:
    """The choices, read from the registries each time (a newly registered algorithm appears)."""
    return {"algorithm.adv_estimator": sorted(ADV_ESTIMATORS), "actor.policy_loss": sorted(POLICY_LOSSES),
            "actor.loss_agg_mode": list(AGG_MODES), "kl_type": list(KL_PENALTIES)}


class DataflowEditor(widgets.VBox):
    """Stages (on/off, with role, inputs and outputs), algorithm selectors, live hyperparameters."""

    def __init__(self, rl: "SessionVerbs"):
        self.rl = rl
        choices = _registries()
        self.selectors = {key: widgets.Dropdown(options=options, description=key.split(".")[-1],
                                                style={"description_width": "120px"})
                          for key, options in choices.items() if key != "kl_type"}
        self.kl_place = widgets.ToggleButtons(options=KL_PLACES, description="KL")
        self.kl_type = widgets.Dropdown(options=choices["kl_type"], description="KL type")
        self.kl_coef = widgets.FloatText(description="KL coef")
        self.numbers = {key: widgets.FloatText(description=key.split(".")[-1])
                        for key in ("actor.clip_ratio", "actor.entropy_coeff", "actor.lr", "rollout.temperature")}
        self.default_stages = widgets.Checkbox(indent=False, description="the algorithm's default stages")
        self.stages_box = widgets.VBox()
        self.stage_boxes: dict[str, widgets.Checkbox] = {}
        self.status = widgets.HTML()
        self.validate_button = widgets.Button(description="Validate", icon="check")
        self.apply_button = widgets.Button(description="Apply", button_style="primary", icon="play")
        self.validate_button.on_click(lambda _: self.validate())
        self.apply_button.on_click(lambda _: self.apply())
        self.applier = Applier(rl, self.status)
        self.refresh()
        self.default_stages.observe(lambda _: self._enable_stages(), "value")
        self.kl_place.observe(lambda _: self._load_kl(), "value")
        super().__init__([
            widgets.HTML("<b>algorithm</b> (estimators and policy losses from their registries)"),
            *self.selectors.values(), self.kl_place, widgets.HBox([self.kl_type, self.kl_coef]),
            widgets.HTML("<b>hyperparameters</b> (applied to the running workers)"), *self.numbers.values(),
            widgets.HTML("<b>stages</b> of one step (role: inputs &rarr; outputs)"), self.default_stages,
            self.stages_box, widgets.HBox([self.validate_button, self.apply_button]), self.status,
            widgets.HTML(f"<small>{html.escape(FOREGROUND_NOTE)}</small>")])

    def refresh(self) -> None:
        """Fill every widget from the session's config as it is now (after any update, from here or
        from code); Apply sends only what the user changes after this."""
        cfg = self.rl.cfg
        for key, w in {**self.selectors, **self.numbers}.items():
            w.value = _get(cfg, key)
        self.kl_place.value = "in loss" if cfg.actor.use_kl_loss else "in reward" if cfg.algorithm.use_kl_in_reward \
            else "off"
        self._load_kl()
        self.default_stages.value = cfg.dataflow is None
        self.refresh_stages()
        self._baseline = self._values()

    def _load_kl(self) -> None:
        """Show the KL type and coefficient of the place chosen (reward and loss have their own)."""
        cfg, place = self.rl.cfg, self.kl_place.value
        self.kl_type.value = cfg.actor.kl_loss_type if place == "in loss" else cfg.algorithm.kl_penalty
        self.kl_coef.value = _kl_coef(cfg, place)

    def _values(self) -> dict:
        return {**{k: w.value for k, w in {**self.selectors, **self.numbers}.items()},
                "kl": (self.kl_place.value, self.kl_type.value, self.kl_coef.value),
                "default": self.default_stages.value,
                "stages": [n for n, box in self.stage_boxes.items() if box.value]}

    # ------------------------------------------------------------- stages
    def refresh_stages(self) -> None:
        """Rebuild the stage list: the session's stages in order (on), then every other
        registered stage (off)."""
        current = self.rl.dataflow.names
        rows, boxes = [], {}
        for name in [*current, *[n for n in STAGES if n not in current]]:
            stage = STAGES[name]
            boxes[name] = widgets.Checkbox(value=name in current, description=name, indent=False,
                                           layout=widgets.Layout(width="200px"))
            io = f"{stage.role or 'controller'}: {', '.join(stage.inputs(self.rl.cfg))} &rarr; " \
                 f"{', '.join(stage.outputs(self.rl.cfg))}"
            rows.append(widgets.HBox([boxes[name], widgets.HTML(f"<small>{io}</small>")]))
        self.stage_boxes = boxes  # swapped whole: a Validate on the kernel thread never sees half of it
        self.stages_box.children = rows
        self._enable_stages()

    def _enable_stages(self) -> None:
        for box in self.stage_boxes.values():
            box.disabled = self.default_stages.value

    # ------------------------------------------------------------ overrides
    def overrides(self) -> list[str]:
        """Return the ``key=value`` changes the user made in the widgets since they were filled
        (changes made meanwhile from code or another editor are left as they are)."""
        now, base, out = self._values(), self._baseline, []
        for key in [*self.selectors, *self.numbers]:
            if now[key] != base[key]:
                out.append(f"{key}={json.dumps(now[key])}")
        if now["kl"] != base["kl"]:
            place, kl_type, coef = now["kl"]
            if place != base["kl"][0]:
                out += [f"actor.use_kl_loss={json.dumps(place == 'in loss')}",
                        f"algorithm.use_kl_in_reward={json.dumps(place == 'in reward')}"]
            if place == "in loss":
                out += [f"actor.kl_loss_type={kl_type}", f"actor.kl_loss_coef={coef}"]
            elif place == "in reward":
                out += [f"algorithm.kl_penalty={kl_type}", f"algorithm.kl_ctrl.kl_coef={coef}"]
        if now["default"] and not base["default"]:
            out.append("dataflow=null")
        elif not now["default"] and now["stages"] != base["stages"]:
            out.append(f"dataflow={json.dumps(now['stages'])}")
        return out

    def validate(self) -> list[str]:
        """Show the problems of the edit (or the stages it would run); returns the problems."""
        try:
            stages = self.rl.check_update(*self.overrides())
        except Exception as exc:  # ConfigError / DataflowError: their lines are the problems
            found = problems_of(exc)
            self.status.value = problem_list("This edit cannot run:", found)
            return found
        self.status.value = ok("This edit can run. Stages: " + " → ".join(stages))
        return []

    def apply(self) -> None:
        """Apply the edit with ``rl.update`` (at the next step boundary during a background run)."""
        overrides = self.overrides()
        if not overrides:
            self.status.value = ok("Nothing to apply: the widgets match the session.")
            return

        def done(_) -> str:
            self.refresh()
            return ok(f"Applied for step {self.rl.state.step_count + 1}: {', '.join(overrides)}. Stages: "
                      + " → ".join(self.rl.dataflow.names))

        self.applier(lambda: self.rl.update(*overrides), done)


def _get(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _kl_coef(cfg, place: str) -> float:
    return cfg.actor.kl_loss_coef if place == "in loss" else cfg.algorithm.kl_ctrl.kl_coef
