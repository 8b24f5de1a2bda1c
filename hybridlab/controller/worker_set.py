"""WorkerSet: the controller a notebook kernel holds for as long as it lives.

It owns the Ray connection, the device mapping, one resource pool per mapping pool and one
WorkerGroup per role. ``remap`` changes the mapping between steps, re-creating only the
worker processes whose placement changed; hooks carry model state across. With ``spares=N``
it keeps N warmed-up processes (controller/spares.py) that remaps and re-created roles use
instead of starting new ones.
"""
from __future__ import annotations

from typing import Any, Callable

import ray

from hybridlab.controller.group import DEFAULT_TIMEOUT_S, HostSet, RoleClass, WorkerGroup, spawn_hosts
from hybridlab.controller.mapping import DeviceMapping, MappingError
from hybridlab.controller.resources import ResourcePool, connect
from hybridlab.controller.spares import SparePool
from hybridlab.controller.warm_pool import WarmPool
from hybridlab.controller.watch import CallWatch
from hybridlab.telemetry.timeline import Timeline

SaveHook = Callable[[str, WorkerGroup], Any]          # (role, old group) -> state
LoadHook = Callable[[str, WorkerGroup, Any], None]    # (role, new group, state)


class WorkerSet:
    """Holds the cluster connection, pools and worker groups of one device mapping."""

    def __init__(self, mapping: DeviceMapping, workers: dict[str, RoleClass | type], *,
                 address: str | None = None, num_gpus: int | None = None, model: Any = None,
                 env: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S, ray_temp_dir: str | None = None,
                 spares: int = 0, warm: WarmPool | None = None, warm_roles: dict[str, type] | None = None):
        self.mapping = mapping
        # the kernel's warm pool (controller/warm_pool.py): adopted from at start, refilled after it
        # with processes that can host ``warm_roles`` (default: this set's roles)
        self.warm, self.warm_roles = warm, dict(warm_roles or {})
        self.role_classes = {r: w if isinstance(w, RoleClass) else RoleClass(w) for r, w in workers.items()}
        self.model, self.env, self.timeout = model, dict(env or {}), timeout
        self._connect_args = dict(address=address, num_gpus=num_gpus, temp_dir=ray_temp_dir)
        self.timeline = Timeline()
        self.watch = CallWatch(first_s=timeout)  # every call in flight, its deadline, stuck-call stacks
        self.pools: dict[str, ResourcePool] = {}
        self.groups: dict[str, WorkerGroup] = {}
        self._sets: list[HostSet] = []
        self._hooks: list[tuple[SaveHook | None, LoadHook | None]] = []
        self.spares: SparePool | None = None
        self._spare_count = 0
        self.set_spares(spares)  # checked now; the spares start with the workers
        self._check(mapping)

    def worker_pids(self) -> set[int]:
        """Return the process ids of every worker process (each process set's hosts)."""
        return {p["pid"] for s in self._sets for p in s.placements}

    # ------------------------------------------------------------ lifecycle
    def _check(self, mapping: DeviceMapping, cluster_gpus: float | None = None) -> None:
        have = ", ".join(self.role_classes) or "none"
        mapping.validate(self.model, cluster_gpus, extra=[
            f"roles.{r}: no worker class was given for this role (have: {have})"
            for r in mapping.roles if r not in self.role_classes])

    def start(self) -> "WorkerSet":
        """Connect to Ray, reserve the pools and start every role's workers; returns self.

        Calling it on a started session does nothing (``with WorkerSet(...).start()`` is fine).
        """
        if self._sets:
            return self
        resources = connect(**self._connect_args)
        self._check(self.mapping, resources.get("GPU", 0))
        self._spawn(self.mapping, list(self.mapping.process_sets()))
        self.set_spares(self._spare_count)  # after the workers are built (they then share the cores with the first steps)
        if self.warm is not None and self.warm.size:  # for the next session of this process
            modules = ray.get([s.hosts[0].loaded_modules.remote(libraries_only=True) for s in self._sets],
                              timeout=self.timeout)
            self.warm.refill({**{r: w.cls for r, w in self.role_classes.items()}, **self.warm_roles}, self.env,
                             [name for names in modules for name in names])
        return self

    def _spare_pools(self) -> list[SparePool]:
        """Return the pools a new process may come from: this set's spares, then the kernel's."""
        kernel = self.warm.pool() if self.warm is not None else None
        return [p for p in (self.spares, kernel) if p is not None]

    def _learn_modules(self, sets: list[HostSet]) -> None:
        """Let spares import what these worker processes imported (the engines import most of
        theirs lazily while they are built: the cost a spare is for)."""
        if self.spares is not None and sets:
            for names in ray.get([s.hosts[0].loaded_modules.remote() for s in sets], timeout=self.timeout):
                self.spares.learn_modules(names)

    def set_spares(self, n: int) -> None:
        """Keep ``n`` warmed-up spare processes for remaps and re-created roles (0: none); the
        missing ones start now and warm up in the background."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"spares must be a whole number >= 0, got {n!r}")
        self._spare_count = n
        if not self._sets:  # not started: start() keeps them
            return
        if self.spares is None and n:
            self.spares = SparePool({r: w.cls for r, w in self.role_classes.items()}, self.env)
            self._learn_modules(self._sets)
        if self.spares is not None:
            self.spares.resize(n)

    def __enter__(self) -> "WorkerSet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _pool(self, mapping: DeviceMapping, name: str) -> ResourcePool:
        spec = mapping.pools[name]
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = ResourcePool(name, spec.devices, spec.strategy, spec.cpus_per_device,
                                                    spec.node_labels)
        return pool.create()

    def _spawn(self, mapping: DeviceMapping, sets: list[tuple[str, tuple[str, ...]]]) -> None:
        """Start the process sets ``(pool, roles)`` one after the other (in spares where there
        are some), then make each its roles' groups. On a failure none stays.

        One at a time: a set's rendezvous port is asked of the OS while the previous set's is
        already bound, so two sets can never be handed the same port."""
        done: list[HostSet] = []
        try:
            for pool_name, members in sets:
                pool = self._pool(mapping, pool_name)
                sharing = mapping.sets_in_pool(pool_name)
                done.append(spawn_hosts(pool.bundles(), {m: self.role_classes[m] for m in members},
                                        gpus=1.0 / sharing, cpus=pool.cpus_per_device / sharing, env=self.env,
                                        timeout=self.timeout, spares=self._spare_pools()))
        except BaseException:
            for hostset in done:
                hostset.kill(close_timeout=5.0)
            raise
        for hostset in done:
            self._sets.append(hostset)
            for m in hostset.roles:
                self.groups[m] = WorkerGroup(m, self.role_classes[m].cls, hostset, self.timeline, self.timeout, self.watch)
        self._learn_modules(done)  # a role new to the spares (a critic added later) is warmed from now on

    def _teardown(self, roles: set[str], close_timeout: float = 15.0) -> None:
        for hostset in [s for s in self._sets if set(s.roles) & roles]:
            hostset.kill(close_timeout)
            self._sets.remove(hostset)
            self.watch.forget(set(hostset.roles))
            for m in hostset.roles:
                self.groups.pop(m, None)

    def shutdown(self) -> None:
        """Stop every worker process and spare and release the pools (the Ray connection stays)."""
        if self.spares is not None:
            self.spares.shutdown()
        self._teardown(set(self.groups) | {r for s in self._sets for r in s.roles})
        for pool in self.pools.values():
            pool.remove()
        self.pools.clear()

    # --------------------------------------------------------------- changes
    def add_remap_hook(self, save: SaveHook | None = None, load: LoadHook | None = None) -> None:
        """Run ``save(role, old_group)`` before a role's processes go and ``load(role, new_group, state)``
        after its new ones start, whenever ``remap`` or ``recreate`` replaces them."""
        self._hooks.append((save, load))

    def remove_remap_hook(self, save: SaveHook | None = None, load: LoadHook | None = None) -> None:
        """Remove hooks added with ``add_remap_hook`` (the same two objects)."""
        self._hooks.remove((save, load))

    def remap(self, new: DeviceMapping, workers: dict[str, RoleClass | type] | None = None,
              recreate: set[str] | frozenset = frozenset(), refill: bool = True) -> set[str]:
        """Switch to mapping ``new``, re-creating only the roles whose placement changed (plus
        ``recreate``, e.g. roles whose built-in settings changed, with the roles that share their
        processes); returns the re-created roles. ``workers`` gives classes for new roles or new
        constructor arguments for existing ones. Spares used are replaced at the end, or, with
        ``refill=False``, when the caller calls ``refill_spares()`` (after its own follow-up work).

        Everything is validated first: on an error nothing is touched.
        """
        merged = {**self.role_classes, **{r: w if isinstance(w, RoleClass) else RoleClass(w)
                                     for r, w in (workers or {}).items()}}
        have = ", ".join(merged) or "none"
        new.validate(self.model, ray.cluster_resources().get("GPU", 0), extra=[
            f"roles.{r}: no worker class was given for this role (have: {have})" for r in new.roles if r not in merged])
        joining = self._joining(new)
        staying = {r for hostset in joining.values() for r in hostset.roles}
        # a role new to the mapping is built fresh either way: its "re-create" never drags its set along
        changed = self.mapping.changed_roles(new) - staying - set(joining)
        changed |= set(recreate) & set(self.mapping.roles)
        for mapping in (self.mapping, new):  # a re-created role takes the roles sharing its processes along
            for _, members in mapping.process_sets():
                if changed & set(members):
                    changed |= set(members)
        joining = {r: hostset for r, hostset in joining.items() if not changed & {r, *hostset.roles}}
        states = self._save(changed)
        self._teardown(changed)
        self.role_classes = {r: w for r, w in merged.items() if r in new.roles}
        used = {r.pool for r in new.roles.values()}
        live = {self.mapping.roles[r].pool for s in self._sets for r in s.roles}
        for name in list(self.pools):  # release pools that changed shape or lost all their roles
            if name not in live and (name not in used or new.pools.get(name) != self.mapping.pools.get(name)):
                self.pools.pop(name).remove()
        self.mapping = new
        if self.spares is not None:  # a spare can host a role added by this remap, too
            self.spares.add_roles({r: w.cls for r, w in self.role_classes.items()})
        self._spawn(new, [(pool, members) for pool, members in new.process_sets() if set(members) & changed])
        self._load(changed, states)
        for role, hostset in joining.items():  # built in the running processes, beside the roles there
            try:
                with hostset.lock:
                    hostset.add_roles({role: self.role_classes[role]}, timeout=self.timeout)
            except BaseException:  # a rank may hold a half-built role: the set cannot be trusted
                self._teardown(set(hostset.roles) | {role})
                raise
            self.groups[role] = WorkerGroup(role, self.role_classes[role].cls, hostset, self.timeline, self.timeout,
                                            self.watch)
        if refill:
            self.refill_spares()
        return changed

    def _joining(self, new: DeviceMapping) -> dict[str, HostSet]:
        """Return the roles that ``new`` adds to a running process set -> that set, where they can
        be built in its processes without re-creating them: the set keeps its pool, its roles keep
        their layouts, and the pool is split among as many sets as before."""
        old, out = self.mapping, {}
        for pool, members in new.process_sets():
            added, kept = [r for r in members if r not in old.roles], {r for r in members if r in old.roles}
            hostset = next((h for h in self._sets if set(h.roles) == kept), None)
            same_place = old.pools.get(pool) == new.pools[pool] and old.sets_in_pool(pool) == new.sets_in_pool(pool)
            if added and hostset is not None and same_place and all(old.roles[r] == new.roles[r] for r in kept):
                out.update({r: hostset for r in added})
        return out

    def refill_spares(self) -> None:
        """Start spares in place of those used (they warm up in the background)."""
        if self.spares is not None:
            self.spares.refill()

    def recreate(self, role: str, close_timeout: float = 15.0) -> WorkerGroup:
        """Replace the processes of ``role`` (and of roles colocated with it) on the same
        placement; returns its new group. Use it after a worker died or got stuck (then give a
        short ``close_timeout``: a stuck process cannot clean up): the remap hooks reload state.
        """
        if role not in self.mapping.roles:
            raise MappingError(f"no role {role!r} in the mapping; roles: {', '.join(self.mapping.roles)}")
        pool, members = next((p, m) for p, m in self.mapping.process_sets() if role in m)
        states = self._save(set(members), tolerate_dead=True)
        self._teardown(set(members), close_timeout)
        self._spawn(self.mapping, [(pool, members)])
        self._load(set(members), states)
        self.refill_spares()
        return self.groups[role]

    def dead_roles(self, timeout: float = 10.0, exclude: set[str] = frozenset(),
                   only: set[str] | None = None) -> set[str]:
        """Return the roles whose processes do not all answer a ping within ``timeout`` s (the
        process sets of roles in ``exclude`` are not asked; with ``only``, only theirs are)."""
        dead: set[str] = set()
        for hostset in [s for s in self._sets if not set(s.roles) & exclude
                        and (only is None or set(s.roles) & only)]:
            group = self.groups.get(hostset.roles[0])
            if group is not None and not group.ping(timeout):
                dead |= set(hostset.roles)
        return dead

    def colocated(self, role: str) -> tuple[str, ...]:
        """Return the roles that share ``role``'s processes (itself included)."""
        return next(m for _, m in self.mapping.process_sets() if role in m)

    def _save(self, roles: set[str], tolerate_dead: bool = False) -> dict:
        states: dict[str, list] = {}
        if not self._hooks:
            return states
        for role in roles:
            group = self.groups.get(role)
            if group is None or (tolerate_dead and not group.ping()):
                continue
            states[role] = [save(role, group) if save else None for save, _ in self._hooks]
        return states

    def _load(self, roles: set[str], states: dict) -> None:
        for role in roles:
            if role in self.groups:
                for (_, load), state in zip(self._hooks, states.get(role, [None] * len(self._hooks))):
                    if load:
                        load(role, self.groups[role], state)

    def __repr__(self) -> str:
        groups = ", ".join(f"{r} x{g.world_size}" for r, g in self.groups.items())
        return f"WorkerSet(pools={list(self.pools)}, groups=[{groups}])"
