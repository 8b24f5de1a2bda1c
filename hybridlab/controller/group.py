"""WorkerGroup: the controller-side handle of one role, whose methods fan out to its ranks.

``spawn_hosts`` places one WorkerHost per device bundle of a resource pool (a new process, or
a warmed-up spare), orders them by (node, device) so ranks map to devices stably, wires the
torch.distributed rendezvous and constructs the role workers. Roles built into the same hosts
are colocated (one process); each gets its own WorkerGroup over the shared hosts.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridlab.controller.calls import WorkerError, get_all
from hybridlab.controller.spares import SparePool, bundle_devices
from hybridlab.controller.watch import CallWatch, dump_stacks
from hybridlab.controller.worker import Dispatch, host_actor_class, registered_methods
from hybridlab.batching import concat_sequences
from hybridlab.protocol import Batch
from hybridlab.telemetry.timeline import Span, Timeline

DEFAULT_TIMEOUT_S = 600.0
INLINE_BYTES = 100 * 1024  # Ray's limit for passing an argument inline rather than via the store


@dataclasses.dataclass
class RoleClass:
    """A role's worker class and its constructor arguments."""

    cls: type
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class HostSet:
    """The worker processes of one or more colocated roles, in rank order."""

    hosts: list
    placements: list[dict]
    roles: tuple[str, ...]
    # Calls from concurrent threads (dataflow stages) are submitted to all ranks under this
    # lock, so every rank runs them in the same order: colocated roles share collectives.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add_roles(self, roles: dict[str, "RoleClass"], timeout: float | None = None) -> None:
        """Construct ``roles`` in these running processes, beside the roles they host (whose
        workers, weights and engines stay as they are); raises WorkerError if one fails."""
        specs = {name: (rc.cls, rc.args, rc.kwargs) for name, rc in roles.items()}
        refs = [h.add_roles.remote(specs) for h in self.hosts]
        get_all(refs, list(range(len(self.hosts))), ",".join(roles), "__init__", timeout)
        self.roles = (*self.roles, *roles)

    def kill(self, close_timeout: float = 15.0) -> None:
        """Let each worker clean up (``close``), then terminate every process of the set (their
        roles' groups become unusable). A process that does not answer within
        ``close_timeout`` seconds is killed all the same."""
        refs = [h.close.remote() for h in self.hosts]
        try:
            ray.wait(refs, num_returns=len(refs), timeout=close_timeout)
        except Exception:  # dead processes
            pass
        for h in self.hosts:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already dead
                pass


def _spare_offers(bundles: Sequence[tuple[Any, int]], roles: dict[str, RoleClass], spares: Sequence[SparePool],
                  cpus: float, gpus: float, timeout: float) -> list[dict | None]:
    """Return, per bundle, its node and devices where a spare process could take it (else None)."""
    offers: list = [None] * len(bundles)
    classes = {name: rc.cls for name, rc in roles.items()}
    usable = sum(s.can_host(classes) for pool in spares for s in pool.spares)
    if usable:
        asked = [bundle_devices.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i)).remote() for pg, i in bundles[:usable]]
        try:
            offers[:usable] = ray.get(asked, timeout=timeout)
        except GetTimeoutError:
            raise WorkerError(",".join(roles), 0, "start", f"the pool's devices were not free within {timeout:.0f} s",
                              kind="timed out") from None
    return offers


def spawn_hosts(bundles: Sequence[tuple[Any, int]], roles: dict[str, RoleClass], *, gpus: float = 1.0,
                cpus: float = 1.0, env: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                spares: Sequence[SparePool] = ()) -> HostSet:
    """Place one worker process per (placement group, bundle index) and construct ``roles`` in
    each; returns the set. A process comes from the first of ``spares`` (pools of warmed-up
    processes: the session's, then the kernel's) with one on the bundle's node that can host
    ``roles``; it adopts the bundle's devices and ``env``. Else a process is started here."""
    env = {k: str(v) for k, v in (env or {}).items()}
    classes = {name: rc.cls for name, rc in roles.items()}
    # An empty runtime_env still forces fresh processes; pass one only when there is an env to set.
    actor_class = host_actor_class(classes)

    def placed(pg, i) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

    def fresh(pg, i):
        return actor_class.options(num_cpus=cpus, num_gpus=gpus, runtime_env={"env_vars": env} if env else None,
                                   scheduling_strategy=placed(pg, i)).remote(env)

    offers = _spare_offers(bundles, roles, spares, cpus, gpus, timeout)
    # What a new process would get from Ray (the session's env usually sets it for all).
    threads = int(env.get("OMP_NUM_THREADS") or max(1, int(cpus)))
    hosts, placements = [], []
    try:
        for (pg, i), offer in zip(bundles, offers):
            spare = next((a for a in (p.take(offer["node_id"], classes) for p in spares) if a is not None),
                         None) if offer else None
            if spare is not None:
                lease = {**offer, "env": {**env, **offer["env"]}}  # what a new process here would have had
                try:
                    placements.append(ray.get(spare.adopt.remote(lease, threads), timeout=60.0))
                    hosts.append(spare)
                    continue
                except (RayError, GetTimeoutError):  # it died on the way: a new process instead
                    ray.kill(spare, no_restart=True)
            hosts.append(fresh(pg, i))
            placements.append(hosts[-1].placement.remote())
        placements = [p if isinstance(p, dict) else ray.get(p, timeout=timeout) for p in placements]
    except GetTimeoutError:
        HostSet(hosts, [], tuple(roles)).kill(close_timeout=0)
        raise WorkerError(",".join(roles), 0, "start", f"worker processes did not start within {timeout:.0f} s"
                          " (are the pool's devices free?)", kind="timed out") from None
    except BaseException:
        HostSet(hosts, [], tuple(roles)).kill(close_timeout=0)
        raise
    order = sorted(range(len(hosts)), key=lambda i: (placements[i]["ip"], placements[i]["node_id"],
                                                     placements[i]["gpu_ids"], i))
    hosts = [hosts[i] for i in order]
    placements = [placements[i] for i in order]
    master = (placements[0]["ip"], ray.get(hosts[0].free_port.remote(), timeout=timeout))
    specs = {name: (rc.cls, rc.args, rc.kwargs) for name, rc in roles.items()}
    refs = [h.start.remote(rank, len(hosts), master, specs) for rank, h in enumerate(hosts)]
    hostset = HostSet(hosts, placements, tuple(roles))
    try:
        get_all(refs, list(range(len(hosts))), ",".join(roles), "__init__", timeout)
    except BaseException:
        hostset.kill()
        raise
    return hostset


class _GenericEntry:
    """``role.method`` through a host's generic ``call`` entry, for a role that joined the host
    after it started (its actor class has no direct ``role__method`` for it)."""

    def __init__(self, host, role: str, method: str):
        self.host, self.header = host, (role, method, True)

    def remote(self, *args, **kwargs):
        """Submit the call; returns its ObjectRef, as an actor method's ``remote`` does."""
        return self.host.call.remote(self.header, *args, **kwargs)


def _entry(host, role: str, method: str):
    """Return the host's direct actor method for ``role.method``, or the generic entry."""
    try:
        return getattr(host, f"{role}__{method}")
    except AttributeError:
        return _GenericEntry(host, role, method)


class GroupFuture:
    """The pending result of a WorkerGroup call; ``result()`` waits and returns it."""

    def __init__(self, group: "WorkerGroup", method: str, refs: list, ranks: list[int],
                 finish: Callable[[list], Any], units: int = 1):
        self.group, self.method, self._refs, self._ranks, self._finish = group, method, refs, ranks, finish
        self.units = units  # steps of work in the call (a step's mini-batches): its deadline is per step
        self._done, self._value = False, None
        self.stage = group.timeline.stage  # the submitting thread's stage, whoever collects the result
        self._call = group.watch.begin(group.role, method, self.stage, ranks,
                                       [group.placements[r]["pid"] for r in ranks if r < len(group.placements)],
                                       units)

    def unwatch(self) -> None:
        """Take the call off the watch's list of calls in flight, for a call whose answer is
        read later (a streaming sync's last load): its deadline then counts from ``result()``."""
        self.group.watch.end(self._call, ok=False)

    def done(self) -> bool:
        """Return True once every rank has answered (without waiting)."""
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def result(self, timeout: float | None = None) -> Any:
        """Wait and return the collected result: at most ``timeout`` s if given, else until the
        call's deadline (see CallWatch), past which its stacks are written and it is reported
        as stuck (WorkerError of kind "stuck")."""
        if not self._done:
            g = self.group
            watched = timeout is None
            if watched:
                deadline = g.watch.deadline(g.role, self.method, self.stage, self.units)
                timeout = max(0.0, g.watch.started(self._call) + deadline - time.time())
            try:
                answers = get_all(self._refs, self._ranks, g.role, self.method, timeout)
            except WorkerError as err:
                if watched and err.kind == "timed out":
                    # still in flight (and late) until its processes are replaced: WorkerSet's
                    # teardown forgets it, so a viewer sees the stuck call through the recovery
                    raise self._stuck(err.rank, deadline) from None
                g.watch.end(self._call, ok=False)
                raise
            g.watch.end(self._call, ok=True)
            g.timeline.add([Span(role=s[0], rank=s[1], method=s[2], start=s[3], end=s[4], bytes_in=s[5],
                                 bytes_out=s[6], pid=s[7], stage=self.stage) for _, s in answers])
            self._value = self._finish([r for r, _ in answers])
            self._done = True
        return self._value

    def _stuck(self, rank: int, deadline: float) -> WorkerError:
        """Write the stacks of the call's processes; returns the error that reports it."""
        g = self.group
        label = f"{time.strftime('%Y%m%d-%H%M%S')}-{g.role}-{self.method}"
        try:
            files = dump_stacks([g.placements[r] for r in self._ranks], g.watch.stacks_dir, label)
            where = f"; the stacks of its processes are in {files[0].parent}/{label}-rank*.txt"
        except Exception as exc:  # the report matters more than the stacks
            where = f"; its stacks could not be written ({exc!r})"
        return WorkerError(g.role, rank, self.method,
                           f"no answer after {deadline:.0f} s, the deadline from recent calls of stage"
                           f" {self.stage or '(none)'!r} (trainer.call_deadline_s and call_deadline_floor_s"
                           f" set it){where}", kind="stuck")


class _Method:
    """A registered worker method bound to a group: call it, or ``.submit`` it for a future."""

    def __init__(self, group: "WorkerGroup", name: str, dispatch: Dispatch, blocking: bool, doc: str):
        self.group, self.name, self.dispatch, self.blocking = group, name, dispatch, blocking
        self.__doc__ = f"[{dispatch.value}] {doc}"

    def __call__(self, *args, **kwargs):
        future = self.submit(*args, **kwargs)
        return future.result() if self.blocking else future

    def submit(self, *args, **kwargs) -> GroupFuture:
        """Start the call on the ranks and return a GroupFuture at once."""
        return self.group._dispatch(self.name, self.dispatch, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self.group.role}.{self.name} dispatch={self.dispatch.value}>"


class WorkerGroup:
    """Handle of one role over its worker processes; registered methods appear as attributes."""

    def __init__(self, role: str, cls: type, hostset: HostSet, timeline: Timeline | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, watch: CallWatch | None = None):
        self.role, self.cls, self.hostset = role, cls, hostset
        self.timeline = timeline if timeline is not None else Timeline()
        self.timeout = timeout
        self.watch = watch if watch is not None else CallWatch(first_s=timeout)
        self._dp: list[tuple[int, int, bool]] | None = None
        self.methods = registered_methods(cls)
        self._remote = {name: [_entry(h, role, name) for h in hostset.hosts] for name in self.methods}
        for name, (dispatch, blocking, doc) in self.methods.items():
            setattr(self, name, _Method(self, name, dispatch, blocking, doc))

    @property
    def world_size(self) -> int:
        """Return the number of ranks (worker processes)."""
        return len(self.hostset.hosts)

    @property
    def placements(self) -> list[dict]:
        """Return, per rank, where it runs (node id, IP, device ids, pid)."""
        return self.hostset.placements

    def dp_layout(self, refresh: bool = False) -> list[tuple[int, int, bool]]:
        """Return each rank's (dp_rank, dp_size, collect), asked once from the workers and cached."""
        if self._dp is None or refresh:
            refs = [h.dp_info.remote(self.role) for h in self.hostset.hosts]
            self._dp = [tuple(x) for x in get_all(refs, list(range(self.world_size)), self.role,
                                                   "dp_info", self.timeout)]
            sizes = {d[1] for d in self._dp}
            collectors = sorted(d[0] for d in self._dp if d[2])
            if len(sizes) != 1 or collectors != list(range(sizes.pop())):
                raise RuntimeError(f"{self.role}: inconsistent data-parallel layout reported by workers: {self._dp}")
        return self._dp

    def _dispatch(self, method: str, dispatch: Dispatch, args: tuple, kwargs: dict) -> GroupFuture:
        with self.hostset.lock:
            return self._submit(method, dispatch, args, kwargs)

    def _submit(self, method: str, dispatch: Dispatch, args: tuple, kwargs: dict) -> GroupFuture:
        hosts = self.hostset.hosts
        remote = self._remote[method]  # per rank: the host's direct actor method for role.method
        ranks = list(range(len(hosts)))
        if dispatch is Dispatch.RANK_ZERO:
            refs = [remote[0].remote(*args, **kwargs)]
            return GroupFuture(self, method, refs, [0], lambda rs: rs[0])
        if dispatch is Dispatch.ALL:
            refs = [m.remote(*args, **kwargs) for m in remote]
            return GroupFuture(self, method, refs, ranks, list)
        if dispatch is Dispatch.RAW:
            for i, a in enumerate([*args, *kwargs.values()]):
                if not isinstance(a, (list, tuple)) or len(a) != len(hosts):
                    raise ValueError(f"{self.role}.{method}: raw dispatch needs every argument to be a list of"
                                     f" {len(hosts)} per-rank values (argument {i} is not)")
            refs = [m.remote(*(a[r] for a in args), **{k: v[r] for k, v in kwargs.items()})
                    for r, m in enumerate(remote)]
            return GroupFuture(self, method, refs, ranks, list)
        return self._dispatch_dp(method, args, kwargs)

    def _dispatch_dp(self, method: str, args: tuple, kwargs: dict) -> GroupFuture:
        layout = self.dp_layout()
        dp_size = layout[0][1]
        shared = len(layout) > dp_size
        pads = [0] * dp_size
        lengths = [-1] * dp_size

        def split(value):
            if _batches(value):
                return _split_each(value, dp_size, shared)
            if not isinstance(value, Batch):
                return [value] * dp_size
            chunks = value.chunk(dp_size)
            for d, c in enumerate(chunks):
                pads[d], lengths[d] = c.meta.get("_pad", 0), len(c)
            if shared:  # TP/PP peers receive the same chunk: store it once, pass the reference
                return [ray.put(c) if c.nbytes >= INLINE_BYTES else c for c in chunks]
            return chunks  # one receiver per chunk: Ray moves large arguments via the store itself

        split_args = [split(a) for a in args]
        split_kwargs = {k: split(v) for k, v in kwargs.items()}
        refs, dp_of_ref = [], []
        for h, m, (dp_rank, _, collect) in zip(self.hostset.hosts, self._remote[method], layout):
            rank_args = [a[dp_rank] for a in split_args]
            rank_kwargs = {k: v[dp_rank] for k, v in split_kwargs.items()}
            # Non-answering TP/PP peers go through the generic entry, which drops their result.
            refs.append(m.remote(*rank_args, **rank_kwargs) if collect else
                        h.call.remote((self.role, method, False), *rank_args, **rank_kwargs))
            dp_of_ref.append(dp_rank if collect else None)

        def finish(results: list) -> Any:
            by_dp = {d: r for d, r in zip(dp_of_ref, results) if d is not None}
            ordered = [by_dp[d] for d in range(dp_size)]
            if all(isinstance(r, Batch) for r in ordered):
                # Sequence batches whose ranks padded their prompts to different widths (agent
                # rollouts render their own prompts) are left-padded to the widest.
                join = concat_sequences if all("prompts" in r.tensors for r in ordered) else Batch.concat
                # Drop the rows computed for padding (only where a result is row-aligned with its chunk).
                return join([r.take(slice(0, len(r) - pads[d])) if pads[d] and len(r) == lengths[d]
                                     else r for d, r in enumerate(ordered)])
            return ordered

        units = max((len(v) for v in (*args, *kwargs.values()) if _batches(v)), default=1)
        return GroupFuture(self, method, refs, list(range(len(refs))), finish, units)

    def ping(self, timeout: float = 10.0) -> bool:
        """Return True if every rank answers within ``timeout`` seconds, else False."""
        try:
            get_all([h.ping.remote() for h in self.hostset.hosts], list(range(self.world_size)),
                     self.role, "ping", timeout)
            return True
        except WorkerError:
            return False

    def __repr__(self) -> str:
        return f"WorkerGroup({self.role}: {self.cls.__name__} x {self.world_size}; methods {sorted(self.methods)})"


def _split_each(batches: list[Batch], dp_size: int, shared: bool) -> list:
    """Return each DP rank's part of a list of Batches (a step's mini-batches): its chunk of every
    one, in order, each split as a lone Batch is. A Batch listed again (the next epoch) gives the
    same chunk objects, which pickling then sends once; where TP/PP peers share a part
    (``shared``), a large one is stored once for them."""
    chunked = {id(b): b.chunk(dp_size) for b in batches}
    parts = [[chunked[id(b)][d] for b in batches] for d in range(dp_size)]
    if shared and sum(chunks[0].nbytes for chunks in chunked.values()) >= INLINE_BYTES:
        return [ray.put(part) for part in parts]
    return parts


def _batches(value: Any) -> bool:
    """True for a list of Batches (a step's mini-batches, one step of work each)."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, Batch) for v in value)
