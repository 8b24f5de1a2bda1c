"""Off-policy generation (``trainer.off_policy``): the rollouts of the next steps, submitted
ahead so that generation overlaps training."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hybridlab.protocol import Batch

if TYPE_CHECKING:
    from hybridlab.dataflow.context import StepContext


class RolloutAhead:
    """Off-policy generation: the rollouts of the next ``trainer.max_staleness`` steps are
    submitted ahead, before this step's update and sync reach the (serially executing) workers,
    so generation overlaps training. A batch submitted during step k samples from weights at
    least as new as step k's, so it is at most ``max_staleness`` updates stale when used."""

    def __init__(self):
        self.pending: list = []   # (GroupFuture, step it was submitted at), oldest first

    def take(self, ctx: "StepContext", batch: Batch,
             submit: Callable[[Batch, dict], object] | None = None) -> tuple[Batch, int]:
        """Return (the responses for this step, their staleness: steps since their submission) and top up the rollouts ahead with this step's prompts (``batch``) and, on
        the first step, further draws. ``submit(prompts, sampling)`` starts one rollout and
        returns its future (default: the rollout group's ``generate``)."""
        step, depth = ctx.state.step_count, ctx.cfg.trainer.max_staleness
        seed = ctx.sampling()["seed"]
        submit = submit or ctx.group("rollout").generate.submit
        if not self.pending:  # nothing ahead yet: this step's prompts now, the next ones ahead
            self.pending.append((submit(batch, ctx.sampling()), step))
            batch = ctx.state.prompts.next()
        future, submitted = self.pending.pop(0)
        out = future.result()
        while len(self.pending) < depth:
            ahead = len(self.pending) + 1
            self.pending.append((submit(batch, ctx.sampling(seed=seed + ahead)), step))
            if len(self.pending) < depth:
                batch = ctx.state.prompts.next()
        return out, step - submitted

    def drop(self) -> None:
        """Let the pending rollouts finish and forget them (settings or workers change): their
        prompts, up to ``max_staleness`` batches, are not trained on."""
        for future, _ in self.pending:
            future.result()
        self.pending = []
