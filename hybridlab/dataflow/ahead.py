"""Off-policy generation (``trainer.off_policy``): the rollouts of the next steps, submitted
ahead so that generation overlaps training."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from hybridlab.dataflow.prompts import ShuffledEpochs
from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext


class Pending(NamedTuple):
    """A rollout submitted ahead."""
    future: object       # the rollout group's GroupFuture
    step: int            # the step it was submitted at
    first_uid: int       # its first prompt's uid (the prompt stream goes back before it)
    prompts: int


class RolloutAhead:
    """Off-policy generation: the rollouts of the next ``trainer.max_staleness`` steps are
    submitted ahead, before this step's update and sync reach the (serially executing) workers,
    so generation overlaps training. A batch submitted during step k samples from weights at
    least as new as step k's, so it is at most ``max_staleness`` updates stale when used.

    Rollouts ahead are never lost: when settings or workers change they are thrown away and the
    prompt stream goes back to before their prompts (``forget``), which the next steps draw and
    generate again (counted in ``regenerated``); a checkpoint saves the stream's position before
    them (``first_uid``), so a resumed run generates them again too."""

    def __init__(self):
        self.pending: list[Pending] = []  # oldest first
        self.regenerated = 0      # prompts whose rollouts ahead were thrown away, to be generated again

    def take(self, ctx: "StepContext", batch: Batch,
             submit: Callable[[Batch, dict], object] | None = None) -> tuple[Batch, int]:
        """Return (the responses for this step, their staleness: steps since their submission) and
        top up the rollouts ahead with this step's prompts (``batch``) and, on the first step,
        further draws. ``submit(prompts, sampling)`` starts one rollout and returns its future
        (default: the rollout group's ``generate``)."""
        step, depth, prompts = ctx.state.step_count, ctx.cfg.trainer.max_staleness, ctx.state.prompts
        prompts.MARKS = max(prompts.MARKS, depth + 2)  # the stream can go back before every batch ahead
        seed = ctx.sampling()["seed"]
        submit = submit or ctx.group("rollout").generate.submit
        if not self.pending:  # nothing ahead yet: this step's prompts now, the next ones ahead
            self.pending.append(Pending(submit(batch, ctx.sampling()), step, batch["uid"][0], len(batch)))
            batch = prompts.next()
        taken = self.pending.pop(0)
        out = taken.future.result()
        while len(self.pending) < depth:
            ahead = len(self.pending) + 1
            self.pending.append(Pending(submit(batch, ctx.sampling(seed=seed + ahead)), step, batch["uid"][0],
                                        len(batch)))
            if len(self.pending) < depth:
                batch = prompts.next()
        return out, step - taken.step

    def first_uid(self) -> int | None:
        """Return the first prompt uid of the oldest rollout ahead (None when none is)."""
        return self.pending[0].first_uid if self.pending else None

    def drop(self, prompts: ShuffledEpochs) -> None:
        """Let the rollouts ahead finish (their workers stay), then ``forget`` them."""
        for entry in self.pending:
            entry.future.result()
        self.forget(prompts)

    def forget(self, prompts: ShuffledEpochs) -> None:
        """Throw the rollouts ahead away without waiting (their workers may be gone) and put the
        prompt stream ``prompts`` back to before their prompts, which later steps draw again."""
        if self.pending:
            prompts.set_state(prompts.state_before(self.first_uid()))
            self.regenerated += sum(entry.prompts for entry in self.pending)
        self.pending = []
