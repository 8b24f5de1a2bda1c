"""The planner: every placement and parallel layout of a config's roles on N devices, ranked by
the cost model's predicted step time, with the reason each rejected one cannot run.

    hybridlab plan CONFIG --devices 8 [--nodes 2] [--profile h100] [KEY=VALUE ...]
    candidates = plan(cfg, 8, load_profile("h100"))   # ranked: the runnable first, fastest first

Placements: all roles colocated on one pool (the hybrid engine), and split into a training pool
(actor, reference, critic sharing processes) and a generation pool (the rollout) of every size
(on several nodes: whole nodes per pool), the reward beside either. Layouts: every tp x pp x dp
of a pool's devices for the training roles (for an MoE model, with every ep that divides dp and
the experts), every tp x dp for the rollout. A candidate is rejected, with its reasons, when the
run's own validation refuses it (heads or layers not divisible, batch sizes that do not split
over dp, ...), when a TP group would span nodes, or when its estimated memory does not fit the
profile's devices (90% of them usable).
"""
from __future__ import annotations

import dataclasses

from hybridlab.advisor.cost_model import Prediction, Workload, pool_devices, predict
from hybridlab.advisor.profile import DeviceProfile
from hybridlab.config import RunConfig
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.dataflow.defaults import dataflow_names, default_mapping
from hybridlab.dataflow.remap_checks import remap_problems
from hybridlab.errors import UserError
from hybridlab.models.zoo import resolve_model

TRAINERS = ("actor", "ref", "critic")
USABLE_MEMORY = 0.9
MANY_DEVICES = 16  # above this, split pools in eighths of the devices (or whole nodes)


@dataclasses.dataclass
class Candidate:
    """One mapping the planner considered: its label, the prediction, or the reasons it cannot run."""

    label: str
    mapping: DeviceMapping
    prediction: Prediction | None = None
    rejected: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Return True when the candidate can run (it has a prediction and no reasons against it)."""
        return self.prediction is not None and not self.rejected


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(devices: int, pipeline: bool = True) -> list[tuple[int, int, int]]:
    """Return every (tp, pp, dp) whose product is ``devices`` (pp 1 only, without ``pipeline``)."""
    return [(tp, pp, devices // (tp * pp)) for tp in _divisors(devices)
            for pp in (_divisors(devices // tp) if pipeline else [1])]


def _roles(cfg: RunConfig) -> list[str]:
    return list(default_mapping(cfg, dataflow_names(cfg))["roles"])


def _pool_mappings(roles: list[str], pools: dict[str, int], colocate: dict[str, str], where: dict[str, str],
                   experts: int = 0):
    """Yield (label, mapping dict) for every layout of the trainers and the rollout on ``pools``
    (with ``experts``, an MoE model's, every expert-parallel size too)."""
    trainers = [r for r in roles if r in TRAINERS]
    train_pool, gen_pool = where.get("actor", "main"), where.get("rollout", "main")
    trainer_layouts = [(tp, pp, dp, ep) for tp, pp, dp in layouts(pools[train_pool])
                       for ep in _divisors(dp) if ep == 1 or (experts and experts % ep == 0)]
    for tp, pp, dp, ep in trainer_layouts:
        for rtp, _, rdp in layouts(pools[gen_pool], pipeline=False):
            spec = {}
            for r in roles:
                pool = where.get(r, "main")
                if r in trainers:
                    spec[r] = {"pool": pool, "tp": tp, "pp": pp, "dp": dp, "ep": ep}
                elif r == "rollout":
                    spec[r] = {"pool": pool, "tp": rtp, "dp": rdp}
                else:
                    spec[r] = {"pool": pool, "dp": pools[pool]}
                spec[r]["colocate"] = colocate[pool]
            label = f"trainers tp{tp} pp{pp} dp{dp}{f' ep{ep}' if ep > 1 else ''}, rollout tp{rtp} dp{rdp}"
            yield label, {"pools": {n: {"devices": d} for n, d in pools.items()}, "roles": spec}


def candidates(cfg: RunConfig, devices: int, nodes: int = 1, experts: int = 0) -> list[tuple[str, dict]]:
    """Return (label, mapping dict) for every placement and layout of the config's roles (for a
    model with ``experts`` routed experts, every expert-parallel size of the trainers too)."""
    roles = _roles(cfg)
    out = [(f"colocated on {devices}: {label}", m)
           for label, m in _pool_mappings(roles, {"main": devices}, {"main": "engine"}, {}, experts)]
    per_node = devices // nodes
    step = per_node if nodes > 1 else (1 if devices <= MANY_DEVICES else max(1, devices // 8))
    for k in range(step, devices, step):
        pools = {"train": k, "gen": devices - k}
        for reward in ("gen", "train"):  # beside the rollout, or beside the trainers (off-policy: not behind it)
            where = {r: "train" if r in TRAINERS else "gen" for r in roles} | {"reward": reward}
            out += [(f"split {k} train + {devices - k} gen, reward on {reward}: {label}", m)
                    for label, m in _pool_mappings(roles, pools, {"train": "train", "gen": "gen"}, where, experts)]
    return out


def _node_problems(mapping: DeviceMapping, per_node: int) -> list[str]:
    return [f"roles.{r}.tp: tp={lay.tp} would span nodes ({per_node} devices per node); a TP group stays in one node"
            for r, lay in mapping.roles.items() if per_node % lay.tp]


def _memory_problems(prediction: Prediction, mapping: DeviceMapping, profile: DeviceProfile,
                     per_node: int) -> list[str]:
    limit = profile.memory_gb * 1024 * USABLE_MEMORY
    if profile.memory_shared:  # one node's memory for all its devices (pools numbered in order, PACKed)
        pools, nodes = pool_devices(mapping), {}
        for device, mb in prediction.memory_mb.items():
            pool, _, index = device.partition("/")
            node = pools[pool][int(index)] // per_node
            nodes[node] = nodes.get(node, 0.0) + mb
        return [f"memory: needs {need / 1024:.1f} GB on node {node}, which has {profile.memory_gb:g} GB"
                f" ({USABLE_MEMORY:.0%} usable)" for node, need in sorted(nodes.items()) if need > limit]
    return [f"memory: needs {mb / 1024:.1f} GB on device {device}, which has {profile.memory_gb:g} GB"
            f" ({USABLE_MEMORY:.0%} usable)" for device, mb in prediction.memory_mb.items() if mb > limit]


def plan(cfg: RunConfig, devices: int, profile: DeviceProfile, nodes: int = 1, work: Workload | None = None,
         response_mean: float | None = None) -> list[Candidate]:
    """Return every candidate mapping of ``cfg`` on ``devices`` devices (``nodes`` nodes), the
    runnable ones first, fastest predicted step first; then the rejected, with their reasons."""
    if not isinstance(devices, int) or devices < 1:
        raise UserError(f"--devices: must be a positive integer, got {devices!r}")
    if not isinstance(nodes, int) or nodes < 1 or devices % nodes:
        raise UserError(f"--nodes: must be a positive integer that divides --devices ({devices}), got {nodes!r}")

    work = work or Workload.of(cfg, response_mean=response_mean)
    model_dir = str(resolve_model(cfg.model, data=cfg.data))  # a directory: the heads and layers are checked too
    out = []
    for label, spec in candidates(cfg, devices, nodes, work.experts):
        mapping = DeviceMapping.from_dict(spec)
        spans = _node_problems(mapping, devices // nodes) if nodes > 1 else []
        c = Candidate(label, mapping, rejected=remap_problems(cfg, mapping, devices, model_dir) + spans)
        if not c.rejected:
            c.prediction = predict(work, cfg, mapping, profile)
            c.rejected = _memory_problems(c.prediction, mapping, profile, devices // nodes)
        out.append(c)
    return sorted(out, key=lambda c: (not c.ok, c.prediction.step_s if c.ok else 0.0))


def table(found: list[Candidate], top: int = 10, rejected: int = 10) -> str:
    """Return the ranked candidates as text: the ``top`` runnable ones with their predicted step,
    busy fraction and peak memory per device, then up to ``rejected`` refused ones with reasons."""
    ok = [c for c in found if c.ok]
    lines = [f"{'rank':>4}  {'step s':>8}  {'busy':>5}  {'peak MB':>8}  mapping"]
    for i, c in enumerate(ok[:top], 1):
        p = c.prediction
        lines.append(f"{i:>4}  {p.step_s:>8.3f}  {p.busy:>5.0%}  {p.peak_memory_mb:>8,.0f}  {c.label}")
    if not ok:
        lines.append("   (no candidate can run)")
    bad = [c for c in found if not c.ok]
    if bad:
        more = f" (the first {rejected})" if len(bad) > rejected else ""
        lines.append(f"rejected: {len(bad)} of {len(found)}{more}")
        lines += [f"  {c.label}: {'; '.join(c.rejected)}" for c in bad[:rejected]]
    return "\n".join(lines)


def best(found: list[Candidate]) -> Candidate:
    """Return the fastest runnable candidate; raises UserError listing why none can run."""
    for c in found:
        if c.ok:
            return c
    reasons = sorted({r for c in found for r in c.rejected})
    raise UserError("no mapping of this config can run on these devices:\n  - " + "\n  - ".join(reasons[:20]))

