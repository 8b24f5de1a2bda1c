"""Live changes of a running RL session's workers: a new device mapping, or settings built into
workers. Both end here: validate everything first (nothing is torn down for a bad request),
then, between steps, re-create only the roles that must change, carrying the trainers' state
(weights, AdamW moments, step, RNG) through Ray's object store, and resync the rollout.

    report = rl.remap({"pools": {...}, "roles": {...}})   # or a DeviceMapping, or YAML text
    report.roles_recreated, report.seconds                # also in RUN_DIR/remaps.jsonl
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any

from hybridlab.config import ConfigError, RunConfig, config_with
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.dataflow.defaults import dataflow_names, default_mapping
from hybridlab.dataflow.graph import Dataflow
from hybridlab.dataflow.pairs import step_inputs
from hybridlab.dataflow.remap_checks import remap_problems
from hybridlab.dataflow.roles import ROLE_SPECS, plan_update, role_classes
from hybridlab.run_config import validate_config
from hybridlab.workers.train.checkpoint import merge_state

if TYPE_CHECKING:
    from hybridlab.dataflow.session import RLSession

REMAP_LOG = "remaps.jsonl"


@dataclasses.dataclass
class RemapReport:
    """What one remap (or re-creation for settings) did."""

    step: int                          # applied after this many steps
    roles_recreated: list[str]         # kept their state (trainers) but got new processes
    roles_added: list[str]
    roles_removed: list[str]
    processes_started: int             # worker processes that joined, spares included
    processes_stopped: int
    spares_used: int                   # of those, warmed-up spares (trainer.spare_processes)
    bytes_moved: int                   # trainer state carried in memory + weights synced to the rollout
    seconds: dict[str, float]          # per phase: save, teardown_and_start, load, sync (if any), total
    mapping_before: dict
    mapping_after: dict
    reason: str = "remap"
    prompts_drawn_again: int = 0       # streaming: prompts in flight or finished, not trained, drawn again after it

    def as_dict(self) -> dict:
        """Return the report as plain data (the run directory's remaps.jsonl, the dashboard)."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        roles = ", ".join(self.roles_recreated) or "none"
        added = f", added {', '.join(self.roles_added)}" if self.roles_added else ""
        removed = f", removed {', '.join(self.roles_removed)}" if self.roles_removed else ""
        return (f"remap after step {self.step}: re-created {roles}{added}{removed}; "
                f"{self.processes_started} processes started ({self.spares_used} of them spares), "
                f"{self.processes_stopped} stopped; {self.bytes_moved / 2**20:.1f} MB moved in memory; "
                f"{self.seconds['total']:.1f} s" + (f"; {self.prompts_drawn_again} streamed prompts not trained yet"
                                                    " drawn again" if self.prompts_drawn_again else ""))


@dataclasses.dataclass
class Change:
    """A validated change of a session: the new config, dataflow and mapping, and what the
    workers must do (live settings per role, roles re-created, whether the mapping changes)."""

    cfg: RunConfig
    flow: Any
    mapping: DeviceMapping
    configure: dict[str, dict]
    recreate: set[str]
    remap: bool
    reason: str


def prepare_update(rl: "RLSession", overrides: tuple[str, ...]) -> Change:
    """Return the Change that ``key=value`` overrides make to ``rl`` as it is now; raises
    ConfigError naming the key (unknown, invalid, fixed for the run) or the remap's problems."""
    new = config_with(rl.cfg.to_dict(), overrides)
    validate_config(new)
    if new.mapping is not None and new.trainer.devices != rl.cfg.trainer.devices:
        raise ConfigError("trainer.devices sizes the default mapping, but this session has an explicit one;"
                          " change mapping=... (or call remap) instead")
    names = dataflow_names(new)
    # The default mapping gains the roles a new setting needs and keeps the ones it has (an idle
    # critic costs nothing; dropping it would re-create every process it shares).
    mapping = DeviceMapping.from_dict(new.mapping or default_mapping(new, names, keep=tuple(rl.mapping.roles)))
    plan = plan_update(rl.cfg, new, mapping.roles)
    remap = rl.workers is not None and (plan.remap or bool(plan.recreate) or mapping != rl.mapping)
    if remap:
        check(rl, new, mapping)
    flow = Dataflow(names).validate(new, mapping.roles, step_inputs(new))
    return Change(new, flow, mapping, plan.configure, plan.recreate, remap, "update")


def prepare_remap(rl: "RLSession", mapping: DeviceMapping) -> Change:
    """Return the Change that moves ``rl`` onto ``mapping``; raises ConfigError listing why not."""
    new = dataclasses.replace(rl.cfg, mapping=mapping.to_dict())
    check(rl, new, mapping)
    return Change(new, Dataflow(dataflow_names(new)), mapping, {}, set(), True, "remap")


def check(rl: "RLSession", cfg: RunConfig, mapping: DeviceMapping) -> None:
    """Raise ConfigError listing every reason ``mapping`` cannot run in ``rl`` (nothing is touched)."""
    import ray

    problems = remap_problems(cfg, mapping, ray.cluster_resources().get("GPU", 0), str(rl.model_dir))
    if problems:
        raise ConfigError("this remap cannot run; the session keeps its mapping:\n  - " + "\n  - ".join(problems))


def apply_change(rl: "RLSession", change: Change) -> RemapReport | None:
    """Apply a prepared Change between steps; returns the RemapReport when workers were
    re-created or moved, else None. A remap that fails after the old workers stopped leaves
    the session marked broken (``rl.broken`` says why; ``step()`` raises it)."""
    if rl.workers is None:  # not started: the workers will be built from the new config
        rl.apply_config(change.cfg, change.flow, {})
        rl.mapping = change.mapping
        return None
    if not change.remap:
        rl.apply_config(change.cfg, change.flow, change.configure)
        return None
    rl.state.ahead.drop(rl.state.prompts)
    drawn_again = len(rl.state.stream.rows)
    if rl.cfg.trainer.streaming:  # streamed prompts not trained yet are generated again on the new mapping
        rl.workers.groups["rollout"].stream_close()
        rl.state.stream.forget(rl.state.prompts)
    try:
        report = apply(rl, change.cfg, change.mapping, change.recreate, change.reason, drawn_again)
    except BaseException as exc:
        rl.broken = (f"a {change.reason} failed after the old workers were stopped ({type(exc).__name__}: {exc});"
                     f" this session cannot continue: call shutdown() and start a new one")
        raise
    # roles that kept their processes take their new live settings (re-created ones have them)
    rl.apply_config(change.cfg, change.flow,
                   {r: v for r, v in change.configure.items() if r not in report.roles_recreated + report.roles_added})
    rl.state.remaps.append(report)
    return report


def apply(rl: "RLSession", cfg: RunConfig, mapping: DeviceMapping, recreate: set[str], reason: str,
          drawn_again: int = 0) -> RemapReport:
    """Switch ``rl`` to ``cfg`` on ``mapping``, re-creating changed roles and ``recreate``;
    returns the report (also written to the run directory and sent to the dashboard; ``drawn_again``:
    the streamed prompts not trained yet that go back into the prompt stream). Call it between
    steps with everything already validated."""
    session = rl.workers
    t0 = time.perf_counter()
    mapping_before = rl.mapping.to_dict()
    pids_before = session.worker_pids()
    taken_before = session.spares.taken if session.spares else 0
    seconds: dict[str, float] = {}
    carried = _CarriedState(rl)
    session.add_remap_hook(carried.save, carried.load)
    try:
        t = time.perf_counter()
        changed = session.remap(mapping, role_classes(cfg, mapping, str(rl.model_dir)), recreate, refill=False)
        elapsed = time.perf_counter() - t
    finally:
        session.remove_remap_hook(carried.save, carried.load)
    seconds["save"], seconds["load"] = carried.save_s, carried.load_s
    seconds["teardown_and_start"] = elapsed - carried.save_s - carried.load_s
    rl.mapping = mapping
    sync_bytes = 0
    fresh = changed | (set(mapping.roles) - set(mapping_before["roles"]))  # re-created or new roles
    if "rollout" in mapping.roles and "actor" in mapping.roles and fresh & {"actor", "rollout"}:
        t = time.perf_counter()
        sync_bytes = rl.sync_weights(reason="remap").bytes_moved  # new engines start from the warm start's weights
        seconds["sync"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t0
    pids_after = session.worker_pids()
    old_roles, new_roles = set(mapping_before["roles"]), set(mapping.roles)
    report = RemapReport(step=rl.state.step_count, roles_recreated=sorted(changed & old_roles & new_roles),
                         roles_added=sorted(new_roles - old_roles), roles_removed=sorted(old_roles - new_roles),
                         processes_started=len(pids_after - pids_before),
                         processes_stopped=len(pids_before - pids_after),
                         spares_used=(session.spares.taken if session.spares else 0) - taken_before,
                         bytes_moved=carried.bytes + sync_bytes, seconds={k: round(v, 3) for k, v in seconds.items()},
                         mapping_before=mapping_before, mapping_after=mapping.to_dict(), reason=reason,
                         prompts_drawn_again=drawn_again)
    with open(rl.run_dir / REMAP_LOG, "a") as f:
        f.write(json.dumps(report.as_dict()) + "\n")
    rl.emit("remap", report.as_dict())
    session.refill_spares()  # after the sync: warming spares would compete with it for the cores
    return report


class _CarriedState:
    """The remap hook that carries a trainer role's state from its old workers to its new ones."""

    def __init__(self, rl: "RLSession"):
        self.rl, self.bytes, self.save_s, self.load_s = rl, 0, 0.0, 0.0

    def save(self, role: str, group) -> Any:
        """Return a reference to the role's state in Ray's object store (None for stateless roles)."""
        import ray

        if not ROLE_SPECS[role].stateful:
            return None
        t = time.perf_counter()
        parts = group.checkpoint_state()
        self.bytes += sum(v.numel() * v.element_size() for named in merge_state(parts).values() for v in named.values())
        ref = ray.put(parts)  # owned by the controller: it outlives the old workers
        self.save_s += time.perf_counter() - t
        return ref

    def load(self, role: str, group, ref: Any) -> None:
        """Load the carried state into the role's new workers (in their new layout)."""
        if ref is None:
            return
        t = time.perf_counter()
        group.load_state([ref])
        self.load_s += time.perf_counter() - t
