"""DeviceMapping: which role runs on which devices, with which TP/PP/DP, and what is colocated.

A mapping is data (YAML or Python) so a notebook can show, edit and validate it before any
process starts::

    pools:
      main: {devices: 4}
    roles:
      actor:   {pool: main, tp: 2, dp: 2, colocate: engine}
      rollout: {pool: main, tp: 1, dp: 4, colocate: engine}   # dp = rollout replicas
      ref:     {pool: main, tp: 2, dp: 2, colocate: engine}
      reward:  {pool: main, dp: 4}

A training role of an MoE model may add ``ep`` (expert parallelism, Megatron's): its data-parallel
ranks then hold ``experts / ep`` of each layer's experts each, so ``ep`` divides ``dp``.

Roles with the same ``colocate`` name share worker processes (the hybrid engine). Roles on
one pool without a shared ``colocate`` get their own processes on the same devices, each
claiming a fraction of a device. Roles on different pools use disjoint devices.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from hybridlab.errors import UserError

ROLES = ("actor", "rollout", "ref", "critic", "reward")
TRAINING_ROLES = ("actor", "ref", "critic")  # run on megatron-core
# a pool's Ray placement strategies; kept here, not beside the placement groups (resources.py),
# so that reading a mapping (the dashboard draws one) does not import Ray
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class MappingError(UserError):
    """A device mapping that cannot work; the message lists every problem, one per line."""


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """A set of ``devices`` device bundles placed with ``strategy``; with ``node_labels``, only on
    Ray nodes that carry those labels (``ray start --labels``), e.g. ``{"hybridlab/node": "gen"}``."""

    devices: int
    strategy: str = "PACK"
    cpus_per_device: float = 1.0
    node_labels: dict | None = dataclasses.field(default=None, hash=False)


@dataclasses.dataclass(frozen=True)
class RoleLayout:
    """Where a role runs and how it is parallelised."""

    pool: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    colocate: str | None = None
    ep: int = 1           # expert parallelism (MoE training roles): ranks of a DP group sharing the experts

    @property
    def world_size(self) -> int:
        """Return tp x pp x dp, the number of worker processes."""
        return self.tp * self.pp * self.dp


class _StrictLoader(yaml.SafeLoader):
    """YAML loader that refuses duplicate keys (PyYAML keeps the last one silently)."""


def _no_duplicates(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise MappingError(f"{key!r} appears twice in the mapping (line {key_node.start_mark.line + 1});"
                               " each pool and role may be listed once")
        seen.add(key)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def _build(cls, where: str, data: Any):
    if not isinstance(data, dict):
        raise MappingError(f"{where}: expected a mapping of fields, got {data!r}")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise MappingError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}; allowed: {', '.join(fields)}")
    return cls(**data)


@dataclasses.dataclass
class DeviceMapping:
    """Pools of devices and the layout of each role on them."""

    pools: dict[str, PoolSpec]
    roles: dict[str, RoleLayout]

    # ------------------------------------------------------------ building
    @classmethod
    def from_dict(cls, data: dict) -> "DeviceMapping":
        """Return a mapping from ``{"pools": {...}, "roles": {...}}``; unknown fields are errors."""
        if not isinstance(data, dict):
            raise MappingError(f"a device mapping must be a mapping with 'pools' and 'roles', got {data!r}")
        extra = [k for k in data if k not in ("pools", "roles")]
        if extra:
            raise MappingError(f"unknown top-level key(s) {extra}; a device mapping has: pools, roles")
        pools = {name: _build(PoolSpec, f"pools.{name}", spec) for name, spec in (data.get("pools") or {}).items()}
        roles = {name: _build(RoleLayout, f"roles.{name}", spec) for name, spec in (data.get("roles") or {}).items()}
        return cls(pools, roles)

    @classmethod
    def from_yaml(cls, source: str | Path) -> "DeviceMapping":
        """Return a mapping parsed from a YAML file path or YAML text."""
        text = Path(source).read_text() if isinstance(source, Path) or (
            isinstance(source, str) and "\n" not in source and Path(source).is_file()) else source
        return cls.from_dict(yaml.load(text, Loader=_StrictLoader))

    @classmethod
    def colocated(cls, devices: int, roles: tuple[str, ...] = ("actor", "rollout", "ref"), tp: int = 1,
                  pp: int = 1) -> "DeviceMapping":
        """Return the hybrid-engine default: ``roles`` share processes on one pool of ``devices``."""
        layouts = {}
        for role in roles:
            rtp, rpp = (tp, 1) if role == "rollout" else (tp, pp)
            layouts[role] = RoleLayout("main", tp=rtp, pp=rpp, dp=devices // (rtp * rpp), colocate="engine")
        return cls({"main": PoolSpec(devices)}, layouts)

    def to_dict(self) -> dict:
        """Return the mapping as plain data (the YAML form)."""
        def clean(obj):  # unset fields left out (ep 1 too: the YAML of dense runs is unchanged)
            return {k: v for k, v in dataclasses.asdict(obj).items() if v is not None and (k, v) != ("ep", 1)}
        return {"pools": {n: clean(p) for n, p in self.pools.items()},
                "roles": {n: clean(r) for n, r in self.roles.items()}}

    def to_yaml(self) -> str:
        """Return the mapping as YAML text."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ---------------------------------------------------------- validation
    def problems(self, model: Any = None, cluster_gpus: float | None = None) -> list[str]:
        """Return every reason this mapping cannot run (empty when it can).

        ``model`` (an HF config or dict) enables the head/layer divisibility checks;
        ``cluster_gpus`` the device-count check.
        """
        out = []
        if not self.pools:
            out.append("pools: at least one pool is needed")
        if not self.roles:
            out.append("roles: at least one role is needed")
        for name, pool in self.pools.items():
            if not isinstance(pool.devices, int) or pool.devices < 1:
                out.append(f"pools.{name}.devices: must be a positive integer, got {pool.devices!r}")
            if pool.strategy not in STRATEGIES:
                out.append(f"pools.{name}.strategy: {pool.strategy!r} is not one of {', '.join(STRATEGIES)}")
            labels = pool.node_labels
            if labels is not None and (not isinstance(labels, dict) or not labels or not all(
                    isinstance(k, str) and k and isinstance(v, str) and v for k, v in labels.items())):
                out.append(f"pools.{name}.node_labels: must map label names to values (strings), e.g."
                           f" {{\"hybridlab/node\": \"gen\"}}, got {labels!r}")
        for name, r in self.roles.items():
            where = f"roles.{name}"
            if name not in ROLES:
                out.append(f"{where}: unknown role; roles are: {', '.join(ROLES)}")
            bad = [k for k in ("tp", "pp", "dp", "ep") if not isinstance(getattr(r, k), int) or getattr(r, k) < 1]
            for k in bad:
                out.append(f"{where}.{k}: must be a positive integer, got {getattr(r, k)!r}")
            if r.pool not in self.pools:
                out.append(f"{where}.pool: no pool named {r.pool!r}; pools are: {', '.join(self.pools) or '(none)'}")
            elif not bad and isinstance(self.pools[r.pool].devices, int) and r.world_size != self.pools[r.pool].devices:
                out.append(f"{where}: tp x pp x dp = {r.tp}x{r.pp}x{r.dp} = {r.world_size}, but pool {r.pool!r} has"
                           f" {self.pools[r.pool].devices} devices; they must be equal")
            if name in ("rollout", "reward") and r.pp != 1:
                out.append(f"{where}.pp: {name} does not use pipeline parallelism; set pp: 1")
            if not bad and r.ep > 1 and name not in TRAINING_ROLES:
                out.append(f"{where}.ep: only training roles ({', '.join(TRAINING_ROLES)}) use expert parallelism;"
                           " set ep: 1")
            elif not bad and r.dp % r.ep:
                out.append(f"{where}.ep: ep={r.ep} must divide dp={r.dp} (expert-parallel ranks are data-parallel"
                           " ranks that share out the experts)")
            if model is not None and not bad:
                out.extend(_model_problems(name, r, model))
        for group, members in self.colocation_groups().items():
            pools = {self.roles[m].pool for m in members}
            if len(pools) > 1:
                out.append(f"colocate {group!r}: roles {', '.join(members)} share processes so they must use one pool,"
                           f" but they are on {', '.join(sorted(pools))}")
            # Megatron's parallel state is per process: colocated training roles share one layout.
            trainers = {m: (self.roles[m].tp, self.roles[m].pp, self.roles[m].ep) for m in members
                        if m in TRAINING_ROLES}
            if len(set(trainers.values())) > 1:
                shapes = ", ".join(f"{m} tp={tp} pp={pp} ep={ep}" for m, (tp, pp, ep) in trainers.items())
                out.append(f"colocate {group!r}: training roles in one process must share tp, pp and ep ({shapes})")
        if cluster_gpus is not None:
            need = sum(p.devices for p in self.pools.values() if isinstance(p.devices, int))
            if need > cluster_gpus:
                out.append(f"too few devices: the pools need {need} devices, the cluster has {cluster_gpus:g} GPUs")
        return out

    def validate(self, model: Any = None, cluster_gpus: float | None = None,
                 extra: list[str] | None = None) -> "DeviceMapping":
        """Raise MappingError listing every problem (plus ``extra`` ones the caller found);
        returns self when the mapping can run."""
        problems = self.problems(model, cluster_gpus) + list(extra or [])
        if problems:
            raise MappingError("device mapping is invalid:\n  - " + "\n  - ".join(problems))
        return self

    # ---------------------------------------------------------- structure
    def colocation_groups(self) -> dict[str, list[str]]:
        """Return ``{colocate name: [roles]}`` for roles that share processes."""
        groups: dict[str, list[str]] = {}
        for name, r in self.roles.items():
            if r.colocate:
                groups.setdefault(r.colocate, []).append(name)
        return groups

    def process_sets(self) -> list[tuple[str, tuple[str, ...]]]:
        """Return (pool, roles) for each set of worker processes: a colocation group or a lone role."""
        sets, seen = [], set()
        for name, r in self.roles.items():
            if name in seen:
                continue
            members = tuple(m for m, o in self.roles.items() if r.colocate and o.colocate == r.colocate) or (name,)
            seen.update(members)
            sets.append((r.pool, members))
        return sets

    def sets_in_pool(self, pool: str) -> int:
        """Return how many process sets share ``pool`` (they split its devices between them)."""
        return sum(1 for p, _ in self.process_sets() if p == pool)

    def changed_roles(self, new: "DeviceMapping") -> set[str]:
        """Return the roles whose processes must be re-created to go from this mapping to ``new``."""
        def set_of(mapping, role):
            sets = mapping.process_sets()
            for pool, members in sets:
                if role in members:
                    # Sets sharing a pool split its devices; a change in their number changes the split.
                    return (pool, members, mapping.pools[pool], tuple(mapping.roles[m] for m in members),
                            mapping.sets_in_pool(pool))
            return None

        roles = set(self.roles) | set(new.roles)
        changed = {r for r in roles if set_of(self, r) != set_of(new, r)}
        # A changed role drags along every role that shares its processes, before or after.
        for mapping in (self, new):
            for _, members in mapping.process_sets():
                if changed & set(members):
                    changed |= set(members)
        return changed


def _model_problems(role: str, r: RoleLayout, model: Any) -> list[str]:
    get = (lambda k: model.get(k)) if isinstance(model, dict) else (lambda k: getattr(model, k, None))
    heads, kv, layers = get("num_attention_heads"), get("num_key_value_heads"), get("num_hidden_layers")
    experts = get("num_experts") or get("num_local_experts")
    where, out = f"roles.{role}", []
    # Megatron splits key/value groups across TP ranks; vLLM may instead replicate them.
    kv_ok = (lambda: kv % r.tp == 0 or r.tp % kv == 0) if role == "rollout" else (lambda: kv % r.tp == 0)
    if heads and heads % r.tp:
        out.append(f"{where}.tp: the model's {heads} attention heads are not divisible by tp={r.tp}")
    elif kv and not kv_ok():
        out.append(f"{where}.tp: the model's {kv} key/value heads are not divisible by tp={r.tp}")
    if layers and r.pp > 1 and layers % r.pp:
        out.append(f"{where}.pp: the model's {layers} layers are not divisible by pp={r.pp}")
    if r.ep > 1 and not experts:
        out.append(f"{where}.ep: ep={r.ep}, but the model has no routed experts (expert parallelism splits them)")
    elif r.ep > 1 and experts % r.ep:
        out.append(f"{where}.ep: the model's {experts} experts are not divisible by ep={r.ep}")
    return out


def rank_label(role: str, layout: RoleLayout, rank: int) -> str:
    """Return what rank ``rank`` of ``role`` is, in words: ``actor tp0 dp1 pp0``, ``rollout engine 1 tp0``."""
    if role == "rollout":
        return f"{role} engine {rank // layout.tp}" + (f" tp{rank % layout.tp}" if layout.tp > 1 else "")
    if role == "reward":
        return f"{role} {rank}"
    tp, rest = rank % layout.tp, rank // layout.tp  # megatron's order: tp fastest, then dp, then pp
    return f"{role} tp{tp} dp{rest % layout.dp} pp{rest // layout.dp}"
