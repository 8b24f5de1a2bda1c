"""Streaming rollouts (``trainer.streaming``): the rollout engines generate continuously and a
step trains the first ``data.prompts_per_step`` prompt groups to finish.

Each rollout process runs its engine in a thread of its own (``workers/rollout/stream.py``). The
controller's ``RolloutStream`` keeps the engines fed: it admits prompts, one group at a time, to
the rank with the fewest in flight, as long as the staleness bound allows, and collects the
groups whose n samples have all finished into a buffer; the generate stage takes a step's groups
from it. A weight sync pauses the engines between two of their steps, loads every bucket in
place and lets them go on (``RolloutStream.sync``): samples in flight become partial, their tokens
labelled with the version that sampled each. A step's sync does not wait for the engines: it asks
them for the groups finished so far, pauses them, sends every bucket and the resume, and returns
once the last bucket is sent; the next take serves its groups from what that look found when
enough have finished, and sends its own look without waiting too, so the actor computes while
the engines load (the engines run the calls in the order sent; their answers are read by the
next sync or evaluation, ``settle``, or by the next take once they have come).

The bound (``trainer.max_staleness`` = K), AReaL's: with k steps done, prompts are admitted
while at most (k + K + 1) batches' worth have been, so a sample admitted now is trained at most
K updates later unless it outlasts the prompts admitted after it. Such a long
sample, once finished, is trained with its staleness recorded (``trainer.stale_samples=train``)
or dropped and counted (``drop``).

Reward is scored in the reward stage, on the reward workers, after the groups are taken: the
engines never wait for it (they are stepped by their own threads, whatever the processes run).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from hybridlab.agents.rollout import agent_batch, agent_sample
from hybridlab.batching import right_padded, sequences_batch
from hybridlab.config import RunConfig
from hybridlab.config.bounds import one_of
from hybridlab.controller.group import GroupFuture
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.dataflow.agent_stages import agent_settings, agentic
from hybridlab.protocol import Batch
from hybridlab.workers.rollout.stream import PARTIAL_MODES

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext
    from hybridlab.reshard.transfer import SyncReport

STALE_SAMPLES = ("train", "drop")
# While a step waits for its groups, each look at the engines waits up to this long on the ranks
# for a group to finish (``EngineStream.take``): one call per finished group rather than a poll
# every few milliseconds, whose calls took the rollout's core from its engine.
TAKE_WAIT_S = 0.1


class RolloutStream:
    """The controller's side of streaming rollouts; see the module docstring."""

    def __init__(self):
        self.rows: dict[int, dict] = {}     # uid -> the prompt's row (its objects), admitted or waiting
        self.waiting: list[int] = []        # uids drawn, not admitted yet, oldest first
        self.in_flight: dict[int, int] = {}  # uid -> the rank generating it
        self.ready: list[dict] = []         # finished groups not trained yet, oldest first
        self.admitted: int | None = None    # prompts admitted in all (None: as many as the steps done trained)
        self.dropped = 0                    # samples dropped past the bound (stale_samples=drop)
        self.consumed: set[int] = set()     # uids trained (or dropped whole), newer than the oldest one not
        self.regenerated = 0                # prompts thrown away in flight or unused, drawn and generated again
        self.pad_id = 0
        self.totals: dict[str, float] = {}  # engine stats summed since the last take
        self.deferred: list[GroupFuture] = []  # calls to the engines sent without waiting, oldest first

    def take(self, ctx: "StepContext", batch: Batch) -> tuple[Batch, dict]:
        """Queue this step's prompts (``batch``), keep the engines fed, and return the first
        ``data.prompts_per_step`` groups to finish, repeated n times with their responses,
        behaviour log-probs and per-token versions (``rollout_versions``), with the metrics.

        When that many have finished already (counting those the last sync's look found), the
        prompts admitted now go to the engines without waiting for the answer: the trainer goes
        on while the engines load the last sync's weights."""
        self._queue(batch)
        self._pin(ctx.state.prompts)
        want, started = ctx.cfg.data.prompts_per_step, time.perf_counter()
        self.settle(wait=False)
        parts = self._admit(ctx)
        if self._within_bound(ctx) >= want:
            self.defer([self._send(ctx, parts, 0.0)])
        else:
            self.settle()
            self._read(self._send(ctx, parts, 0.0).result())  # the first look takes what is ready
            while self._within_bound(ctx) < want:  # the next ones wait for a group to finish
                self._read(self._send(ctx, self._admit(ctx), TAKE_WAIT_S).result())
        groups, self.ready = self.ready[:want], self.ready[want:]
        out = self._batch(ctx, groups)
        return out, self._metrics(ctx, out, time.perf_counter() - started)

    def sync(self, ctx: "StepContext", transfer: Callable[..., "SyncReport"], wait: bool) -> "SyncReport":
        """Load new weights into the running engines with ``transfer`` (``sync_mapped``, given
        ``deferred``, the list for its last load); returns its report. The engines stop between two
        of their steps while every bucket loads, then go on, labelling tokens with the new
        version. Unless ``wait``, the trainer does not wait for them: the engines are asked for
        the groups finished so far first (the next take reads that answer), and the last
        bucket's load and the resume are read at the next ``settle``."""
        rollout = ctx.group("rollout")
        self.settle()
        if wait:
            rollout.stream_pause()
            report = transfer()
            rollout.stream_resume(ctx.state.actor_version)
            return report
        self.defer([self._send(ctx, [[] for _ in range(rollout.world_size)], 0.0), rollout.stream_pause.submit()])
        later: list = []
        report = transfer(deferred=later)
        self.defer([*later, rollout.stream_resume.submit(ctx.state.actor_version)])
        return report

    def defer(self, futures: list[GroupFuture]) -> None:
        """Keep calls to the engines sent without waiting, to read later in the order sent."""
        for future in futures:
            future.unwatch()
        self.deferred += futures

    def settle(self, wait: bool = True) -> None:
        """Read the answers of the calls sent without waiting, in the order sent (a sync's look,
        pause, last load and resume, a take's look): every one, or without ``wait`` those that
        have come, up to the first that has not; raises the WorkerError of a failed one."""
        while self.deferred and (wait or self.deferred[0].done()):
            future = self.deferred.pop(0)
            answers = future.result()
            if future.method == "stream_exchange":
                self._read(answers)

    def oldest(self, prompts) -> int | None:
        """Return the first uid of the draw holding the oldest prompt not trained yet (None: none)."""
        return prompts.draw_start(min(self.rows)) if self.rows else None

    def consumed_since(self, start: int, prompts) -> list[int]:
        """Return the uids from ``start`` on that were trained (drawn again, they are skipped)."""
        return sorted(u for u in self.consumed | prompts.skip if u >= start)

    def forget(self, prompts, read: bool = True) -> None:
        """Throw away every prompt not trained yet (in flight, finished or waiting: the workers'
        streams are the caller's to close) and put the prompt stream back before the oldest of
        them; the prompts trained since are skipped when drawn again (``prompts.skip``). The
        calls sent without waiting are read first (``read``; a failed one raises), or dropped
        unread where their processes are being replaced (a recovery)."""
        if read:
            self.settle()  # what their looks found is thrown away with the rest
        self.deferred = []
        start = self.oldest(prompts)
        if start is not None:
            prompts.skip = set(self.consumed_since(start, prompts))
            self.regenerated += len(self.rows)
            prompts.set_state(prompts.marks[start])
        self.rows, self.waiting, self.in_flight, self.ready, self.consumed = {}, [], {}, [], set()
        self.admitted = prompts.pin = None
        self.totals = {}  # the engines' stats of the looks thrown away: a stream started later reports its own

    def _queue(self, batch: Batch) -> None:
        for i, uid in enumerate(batch["uid"]):
            self.rows[uid] = {k: v[i] for k, v in batch.objects.items()}
            self.waiting.append(uid)

    def _admit(self, ctx: "StepContext") -> list[list]:
        """Admit waiting prompts (drawing more when none wait) while the bound allows, each to
        the rank with the fewest groups in flight: with k steps done, the prompts of batches up
        to k + max_staleness, so a batch is admitted at most max_staleness updates before its
        step. Returns each rank's ``(uid, prompt ids)`` to submit (for agents ``(uid, the prompt's
        agent sample)``; maybe none)."""
        per_step, bound = ctx.cfg.data.prompts_per_step, ctx.cfg.trainer.max_staleness
        if self.admitted is None:  # a new stream, or one rewound: everything before was trained
            self.admitted = ctx.state.step_count * per_step
        ranks = ctx.group("rollout").world_size
        parts: list[list] = [[] for _ in range(ranks)]
        room = (ctx.state.step_count + bound + 1) * per_step - self.admitted
        if room <= 0:
            return parts
        while len(self.waiting) < room:
            self._queue(ctx.state.prompts.next())
        load = [sum(1 for r in self.in_flight.values() if r == rank) for rank in range(ranks)]
        for uid in self.waiting[:room]:
            rank = load.index(min(load))
            load[rank] += 1
            row = self.rows[uid]
            parts[rank].append((uid, agent_sample(row) if agentic(ctx.cfg) else row["prompt_ids"]))
            self.in_flight[uid] = rank
        del self.waiting[:room]
        self.admitted += room
        return parts

    def _send(self, ctx: "StepContext", parts: list[list], wait_s: float) -> GroupFuture:
        """Submit each rank's admitted prompts, asking for the groups its engine finished (a rank
        waits up to ``wait_s`` for one when it has none); returns the call's future. One call
        per rank, so one turn of its engine."""
        order = {"sampling": ctx.sampling(seed=ctx.cfg.trainer.seed), "partial": ctx.cfg.trainer.partial_rollouts,
                 "version": ctx.state.rollout_version, "wait_s": wait_s,
                 "agent": agent_settings(ctx.cfg, ctx.state.rollout_version) if agentic(ctx.cfg) else None}
        return ctx.group("rollout").stream_exchange.submit([{**order, "prompts": part} for part in parts])

    def _read(self, answers: list[dict]) -> None:
        """Move the finished groups of the ranks' answers into ``ready`` (those forgotten
        meanwhile dropped), adding up the engines' stats."""
        for answer in answers:
            self.pad_id = answer["pad_id"]
            for group in answer["groups"]:
                if self.in_flight.pop(group["key"], None) is not None:
                    self.ready.append(group)
            for key, value in (answer["stats"] or {}).items():
                self.totals[key] = self.totals.get(key, 0.0) + value

    def _within_bound(self, ctx: "StepContext") -> int:
        """Drop the ready groups with a sample past the bound (``stale_samples=drop``: the whole
        group, so that every prompt keeps its n samples; counted, and its slot freed); return
        how many groups are ready."""
        if ctx.cfg.trainer.stale_samples == "drop":
            oldest = ctx.state.actor_version - ctx.cfg.trainer.max_staleness
            fresh = [min(_sampled_versions(g), default=oldest) >= oldest for g in self.ready]
            stale = [g for g, ok in zip(self.ready, fresh) if not ok]
            self.dropped += sum(len(_members(g)) for g in stale)
            self.admitted -= len(stale)
            self._consume([g["key"] for g in stale])
            self.ready = [g for g, ok in zip(self.ready, fresh) if ok]
        if len(self.ready) < ctx.cfg.data.prompts_per_step and not self.in_flight:
            raise RuntimeError(f"the rollout stream holds {len(self.ready)} finished groups and none in flight, and the"
                               f" bound admits no more (admitted {self.admitted}, step {ctx.state.step_count})")
        return len(self.ready)

    def _batch(self, ctx: "StepContext", groups: list[dict]) -> Batch:
        """Return the groups as a generated batch (verl's layout; agent trajectories in their
        multi-turn layout), prompts' objects repeated."""
        if "trajectories" in groups[0]:
            out = agent_batch([t for g in groups for t in g["trajectories"]], self.pad_id,
                              ctx.cfg.rollout.max_trajectory_tokens)
        else:
            out = _samples_batch(groups, self.pad_id, ctx.cfg.rollout.max_new_tokens)
        owners = [g["key"] for g in groups for _ in _members(g)]
        for key in self.rows[groups[0]["key"]]:
            out.objects.setdefault(key, [self.rows[uid][key] for uid in owners])
        self._consume([g["key"] for g in groups])
        return out

    def _consume(self, uids: list[int]) -> None:
        """Mark prompts trained; ``consumed`` keeps those newer than the oldest untrained one."""
        for uid in uids:
            self.rows.pop(uid, None)
            self.consumed.add(uid)
        low = min(self.rows, default=None)
        self.consumed = {u for u in self.consumed if low is not None and u > low}

    def _pin(self, prompts) -> None:
        """Keep the prompt stream's mark before the oldest prompt not trained yet, however old."""
        prompts.pin = min(self.rows, default=None)

    def _metrics(self, ctx: "StepContext", out: Batch, wait_s: float) -> dict:
        """Return the step's streaming metrics: staleness of the trained tokens, partial and
        preempted shares, the engines' occupancy and idle share, the buffer, what was dropped."""
        mask = out["response_mask"].bool()
        stale = (ctx.state.actor_version - out["rollout_versions"])[mask].float()
        first, last = out["rollout_versions"].masked_fill(~mask, 10**9).min(-1).values, out["rollout_versions"].max(-1).values
        t, self.totals = self.totals, {}
        samples = len(out)
        ages = {f"rollout/stale_tokens/{int(a)}": int(c) for a, c in zip(*stale.unique(return_counts=True))}
        return {**ages, "rollout/staleness": float(stale.max()) if stale.numel() else 0.0,
                "rollout/staleness_mean": float(stale.mean()) if stale.numel() else 0.0,
                "rollout/partial_share": float((first < last).float().mean()),
                "rollout/preempted": t.get("preempted", 0), "rollout/recomputed": t.get("recomputed", 0),
                "rollout/occupancy": t.get("running", 0) / t["engine_steps"] if t.get("engine_steps") else 0.0,
                "rollout/engine_idle_share": t.get("idle_s", 0) / max(t.get("idle_s", 0) + t.get("busy_s", 0), 1e-9),
                "rollout/engine_busy_s": t.get("busy_s", 0.0),
                "rollout/trainer_wait_s": wait_s, "rollout/buffer_groups": len(self.ready),
                "rollout/in_flight_groups": len(self.in_flight), "rollout/stale_dropped": self.dropped,
                "rollout/samples": samples}


def _members(group: dict) -> list:
    """Return a finished group's samples (or an agent's trajectories)."""
    return group["samples"] if "samples" in group else group["trajectories"]


def _samples_batch(groups: list[dict], pad_id: int, response_len: int) -> Batch:
    """Return the groups' samples in verl's layout with their behaviour log-probs and per-token
    versions, and each sample's prompt ids as generated (maybe truncated)."""
    rows = [(g, s) for g in groups for s in g["samples"]]
    out = sequences_batch([g["prompt_ids"] for g, _ in rows], [s["ids"] for _, s in rows], pad_id,
                          response_len=response_len)
    width = out["responses"].shape[1]
    out.tensors.update(rollout_log_probs=right_padded([s["logprobs"] for _, s in rows], width),
                       rollout_versions=right_padded([s["versions"] for _, s in rows], width, np.int64, -1))
    out.objects["prompt_ids"] = [g["prompt_ids"] for g, _ in rows]
    return out


def _sampled_versions(group: dict) -> list[int]:
    """Return the versions that sampled a finished group's tokens (an agent's model tokens)."""
    if "trajectories" in group:
        return [v for t in group["trajectories"] for v in t.response_versions() if v >= 0]
    return [v for s in group["samples"] for v in s["versions"]]


def stream_problems(cfg: RunConfig, mapping: DeviceMapping) -> list[str]:
    """Return the problems of the streaming settings with ``mapping``, each naming its key."""
    t = cfg.trainer
    p = [*one_of("trainer.partial_rollouts", t.partial_rollouts, PARTIAL_MODES),
         *one_of("trainer.stale_samples", t.stale_samples, STALE_SAMPLES)]
    if not t.streaming:
        return p
    rollout, actor, r = mapping.roles.get("rollout"), mapping.roles.get("actor"), cfg.rollout
    shared = rollout is not None and actor is not None and rollout.colocate is not None \
        and rollout.colocate == actor.colocate
    problems = [
        (r.backend != "vllm", f"needs rollout.backend=vllm, got {r.backend!r}"),
        (t.off_policy, "replaces trainer.off_policy; set trainer.off_policy=false"),
        (r.prefix_caching, "rollout.prefix_caching would serve KV blocks computed under old weights to new prompts;"
                           " set rollout.prefix_caching=false"),
        (rollout is not None and rollout.tp > 1, f"needs mapping.roles.rollout.tp=1 (one engine per process, stepped by"
                                                 f" a thread of its own), got tp={rollout.tp if rollout else 1}"),
        (shared, f"the rollout role shares the actor's processes (colocate {rollout.colocate if shared else ''!r});"
                 " give it processes of its own (another pool or colocate name): the engines generate while the"
                 " actor trains")]
    p += [f"trainer.streaming: {why}" for bad, why in problems if bad]
    return p
