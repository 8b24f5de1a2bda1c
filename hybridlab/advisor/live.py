"""LiveAdvisor: during a run, the measured step against the cost model's prediction, and a faster
mapping when one is predicted: an ``advice`` record every ``trainer.advise_every`` steps, which
the dashboard's Mapping section shows with a button that remaps onto the proposal.

It is a step callback; the prediction and the planning run in a thread of their own, so no step
waits for them. Each record covers the steps since the last remap (at most ``RECENT_STEPS``):
their median step seconds and the mean busy fraction of the trainers' and the generator's
devices (``perf/device_busy/*``, from the workers' spans), beside the prediction for the current
mapping on the same workload (the responses' measured mean length). After a remap the next
record covers only the steps that followed it, so the page checks the prediction that proposed
the remap against what it measured. ``propose`` is set when the best mapping is predicted at
least ``PROPOSE_AT`` times faster than the current one.
"""
from __future__ import annotations

import dataclasses
import statistics
import threading
from typing import TYPE_CHECKING, Callable

from hybridlab.advisor.cost_model import Prediction, Workload, predict, role_busy
from hybridlab.advisor.plan import best, plan
from hybridlab.advisor.profile import DeviceProfile, load_profile
from hybridlab.advisor.suggest import RECENT_STEPS
from hybridlab.config import RunConfig
from hybridlab.controller.mapping import DeviceMapping

if TYPE_CHECKING:
    from hybridlab.dataflow.session_verbs import SessionVerbs

PROPOSE_AT = 1.15
MIN_STEPS = 2  # steps after a remap before it is judged (the first one warms the new processes)
GROUPS = {"trainer": ("actor", "ref", "critic"), "generator": ("rollout",)}


@dataclasses.dataclass
class Snapshot:
    """What an advice reads of the session, taken on the stepping thread between steps: the
    config, the mapping, the steps to judge, each group's GPU ids, whether a remap began them."""

    cfg: RunConfig
    mapping: DeviceMapping
    recent: list[dict]
    gpus: dict[str, list[int]]
    since_step: int
    after_remap: bool

    @classmethod
    def of(cls, rl: "SessionVerbs", since_step: int, after_remap: bool) -> "Snapshot":
        """Return the snapshot of ``rl`` over its steps after ``since_step``."""
        recent = [dict(h) for h in rl.state.history if h["step"] > since_step][-RECENT_STEPS:]
        gpus = {group: sorted({g for r in roles if r in rl.workers.groups for p in rl.workers.groups[r].placements
                               for g in p.get("gpu_ids", [])}) for group, roles in GROUPS.items()}
        return cls(rl.cfg, rl.mapping, recent, gpus, since_step, after_remap)


def measured_busy(snap: Snapshot) -> dict[str, float]:
    """Return the trainers' and the generator's measured busy fraction over the snapshot's steps
    (the mean over their devices of each step's ``perf/device_busy/gpuN``, then over the steps)."""
    out = {}
    for group, gpus in snap.gpus.items():
        keys = [f"perf/device_busy/gpu{g}" for g in gpus]
        per_step = [statistics.mean(h.get(k, 0.0) for k in keys) for h in snap.recent if keys]
        out[group] = round(statistics.mean(per_step), 3) if per_step else 0.0
    return out


def advice(snap: Snapshot, profile: DeviceProfile, work: Workload) -> dict:
    """Return the advice record of a snapshot (see the module docstring); ``work`` is the
    session's workload, whose mean response length is taken from the snapshot's steps."""
    lengths = [h["response_length/mean"] for h in snap.recent if "response_length/mean" in h]
    work = dataclasses.replace(work, response_mean=statistics.mean(lengths) if lengths else work.response_mean)
    current: Prediction = predict(work, snap.cfg, snap.mapping, profile)
    devices = sum(p.devices for p in snap.mapping.pools.values())
    top = best(plan(snap.cfg, devices, profile, work=work))
    measured = round(statistics.median(h["timing/step_s"] for h in snap.recent), 4)
    speedup = current.step_s / top.prediction.step_s if top.prediction.step_s else 1.0
    busy = measured_busy(snap)
    return {"step": snap.recent[-1]["step"], "since_step": snap.since_step, "after_remap": snap.after_remap,
            "steps": len(snap.recent), "profile": profile.name, "mapping": snap.mapping.to_dict(),
            "measured_s": measured, "predicted_s": current.step_s,
            "error": round(current.step_s / measured - 1, 3) if measured else None,
            "busy": {g: {"measured": busy[g], "predicted": round(role_busy(current, snap.mapping, roles), 3)}
                     for g, roles in GROUPS.items()},
            "best": {"label": top.label, "mapping": top.mapping.to_dict(), "predicted_s": top.prediction.step_s},
            "speedup": round(speedup, 3), "propose": speedup >= PROPOSE_AT and top.mapping != snap.mapping}


class LiveAdvisor:
    """See the module docstring; ``emit(kind, record)`` sends the records to the telemetry hub."""

    def __init__(self, rl: "SessionVerbs", emit: Callable[[str, dict], None]):
        self.rl, self.emit = rl, emit
        self._thread: threading.Thread | None = None
        self._remaps_seen = len(rl.state.remaps)
        self._since, self._after_remap = rl.state.step_count, False
        self.last: dict | None = None
        self._work: tuple[tuple, Workload] | None = None  # the workload, and the settings it was read under
        self._profiles: dict[str, DeviceProfile] = {}

    def __call__(self, result) -> None:
        """The step callback: start an advice in the background every ``trainer.advise_every`` steps."""
        rl, every = self.rl, self.rl.cfg.trainer.advise_every
        if len(rl.state.remaps) != self._remaps_seen:  # a remap: the next advice covers only the steps after it
            self._remaps_seen, self._since, self._after_remap = len(rl.state.remaps), rl.state.remaps[-1].step, True
        if not every or result.step % every or result.step - self._since < MIN_STEPS:
            return
        if self._thread is not None and self._thread.is_alive():
            return  # the previous one is still planning
        snap = Snapshot.of(rl, self._since, self._after_remap)
        self._thread = threading.Thread(target=self._advise, args=(snap,), name="live-advisor", daemon=True)
        self._thread.start()

    def wait(self, timeout: float = 60.0) -> None:
        """Wait for the advice in progress, if any."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _workload(self, snap: Snapshot) -> Workload:
        """Return the session's workload, read again only when what it depends on changed."""
        c = snap.cfg
        key = (c.model, repr(c.data), c.rollout.n, c.rollout.max_new_tokens)
        if self._work is None or self._work[0] != key:
            self._work = key, Workload.of(c, self.rl.model_dir)
        return self._work[1]

    def _advise(self, snap: Snapshot) -> None:
        name = snap.cfg.trainer.advisor_profile or "local"
        try:
            if name not in self._profiles:  # tried again each time until it loads (calibrate may run meanwhile)
                self._profiles[name] = load_profile(name)
            record = advice(snap, self._profiles[name], self._workload(snap))
        except Exception as exc:  # no profile yet, or no mapping can run: the page says why (once)
            record = {"step": snap.recent[-1]["step"], "failed": str(exc).strip() or repr(exc)}
            if self.last is not None and self.last.get("failed") == record["failed"]:
                return
        self.last = record
        self.emit("advice", record)
