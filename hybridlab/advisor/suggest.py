"""``rl.suggest_mapping()``: the planner's best mapping for a running session, beside the
prediction for the mapping it runs now.

    s = rl.suggest_mapping()       # Suggestion: best, current, speedup
    s.apply(rl)                    # remap live (rl.remap), as the mapping editor's Apply does

The workload is the session's config on its model; once steps have run, the responses' measured
mean length replaces ``rollout.max_new_tokens``. The devices are those of the session's mapping.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hybridlab.advisor.cost_model import Prediction, Workload, predict
from hybridlab.advisor.plan import Candidate, best, plan
from hybridlab.advisor.profile import DeviceProfile, load_profile

if TYPE_CHECKING:
    from hybridlab.dataflow.session_verbs import SessionVerbs

RECENT_STEPS = 5  # the steps whose response lengths stand for the next ones


@dataclasses.dataclass
class Suggestion:
    """The best candidate, the prediction for the current mapping, and current / best step time."""

    best: Candidate
    current: Prediction
    profile: str

    @property
    def speedup(self) -> float:
        """Return the predicted current step time over the suggested one (above 1: the suggestion is faster)."""
        return self.current.step_s / self.best.prediction.step_s if self.best.prediction.step_s else 1.0

    @property
    def same(self) -> bool:
        """Return True when the suggestion is the mapping the session runs."""
        return self.best.prediction.step_s >= self.current.step_s

    def text(self) -> str:
        """Return the suggestion in one sentence."""
        now, new = self.current.step_s, self.best.prediction.step_s
        if self.same:
            return f"The current mapping is predicted fastest ({now:.3f} s per step on profile {self.profile})."
        return (f"Suggested: {self.best.label}: predicted {new:.3f} s per step against {now:.3f} s now"
                f" ({self.speedup:.2f}x, profile {self.profile}).")

    def apply(self, rl: "SessionVerbs"):
        """Remap ``rl`` onto the suggested mapping; returns rl.remap's report."""
        return rl.remap(self.best.mapping.to_dict())


def session_workload(rl: "SessionVerbs") -> Workload:
    """Return the session's workload, with the recent steps' mean response length when there are any."""
    lengths = [h["response_length/mean"] for h in rl.state.history[-RECENT_STEPS:] if "response_length/mean" in h]
    return Workload.of(rl.cfg, rl.model_dir, response_mean=sum(lengths) / len(lengths) if lengths else None)


def suggest_mapping(rl: "SessionVerbs", profile: DeviceProfile | str | None = None) -> Suggestion:
    """Return the Suggestion for ``rl`` on the devices of its mapping (``profile``: a
    DeviceProfile, a name or file for ``load_profile``; default this machine's)."""
    profile = profile if isinstance(profile, DeviceProfile) else load_profile(profile)
    work = session_workload(rl)
    devices = sum(p.devices for p in rl.mapping.pools.values())
    found = plan(rl.cfg, devices, profile, work=work)
    return Suggestion(best(found), predict(work, rl.cfg, rl.mapping, profile), profile.name)
