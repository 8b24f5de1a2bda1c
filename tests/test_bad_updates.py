"""A NaN loss on the real engines (tiny model): the update is skipped, the weights and the
rollout's copy stay as they were, the skip is counted, and `trainer.max_bad_updates` steps in a
row stop the run with a checkpoint of the last good weights."""
from __future__ import annotations

import pytest
import torch

from hybridlab.dataflow.checkpoints import checkpoint_dirs, read_role
from hybridlab.dataflow.session import RLSession
from hybridlab.dataflow.stages import register_stage
from hybridlab.protocol import Batch
from hybridlab.workers.train.checkpoint import merge_state

POISONED: set[int] = set()  # steps whose advantages become NaN


@register_stage("poison_advantages", None, ("advantages",), ("advantages",))
def poison_advantages(ctx, batch: Batch):
    """Test stage: NaN advantages in the steps listed in POISONED (a broken reward or estimator)."""
    step = ctx.state.step_count + 1
    if step not in POISONED:
        return None, {}
    return Batch({"advantages": torch.full_like(batch["advantages"], float("nan"))}), {}


FLOW = "[generate, reward, rollout_as_old_logprob, advantages, poison_advantages, update_actor, sync_weights]"
SETTINGS = ["warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6",
            "actor.ppo_mini_batch_size=4", "data.test_samples=16", "trainer.progress=false", "trainer.eval_every=0",
            "trainer.max_bad_updates=2", "trainer.save_every=0", f"dataflow={FLOW}"]


@pytest.fixture(scope="module")
def rl(ray_local, trained_dir, tmp_path_factory):
    session = RLSession(None, [f"model={trained_dir}", *SETTINGS,
                               f"trainer.run_dir={tmp_path_factory.mktemp('bad') / 'run'}"]).start()
    yield session
    session.shutdown()


def weights(rl) -> dict[str, torch.Tensor]:
    return merge_state(rl.workers.groups["actor"].checkpoint_state())["model"]


def test_a_nan_update_is_skipped_counted_and_not_synced(rl):
    assert "actor/skipped" in rl.step().metrics and rl.state.bad_updates == 0
    before, version = weights(rl), rl.state.actor_version
    POISONED.add(rl.state.step_count + 1)
    with pytest.warns(RuntimeWarning, match="2 update\\(s\\) skipped for a NaN or inf loss or gradient norm"):
        m = rl.step().metrics
    assert m["actor/skipped"] == 2 and m["faults/bad_updates"] == 2  # both mini-batches
    assert m["sync/skipped"] == 1 and m["sync/bytes"] == 0
    after = weights(rl)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the weights stay as they were
    assert rl.state.actor_version == rl.state.rollout_version == version     # and so does the policy version
    m = rl.step().metrics  # a clean step: updates and syncs again; the count stays
    assert m["actor/skipped"] == 0 and m["faults/bad_updates"] == 2 and m["sync/bytes"] > 0
    assert rl.state.actor_version == rl.state.rollout_version == version + 1
    assert rl.state.bad_steps_in_a_row == 0


def test_max_bad_updates_in_a_row_stop_the_run_with_the_last_good_weights(rl):
    good, start = weights(rl), rl.state.step_count
    POISONED.update(range(start + 1, start + 10))
    summary = rl.train(8)
    assert rl.state.step_count == summary["steps"] == start + 2
    assert "2 steps in a row had a NaN or inf loss or gradient norm" in summary["stopped_by"]
    saved = read_role(checkpoint_dirs(rl.run_dir)[-1] / "actor")["model"]
    assert all(torch.equal(good[k], saved[k]) for k in good)  # the checkpoint holds the last good weights


def odd_lengths(rl, batch) -> list[bool]:
    """Return, per response of the batch in order, whether its text has an odd length."""
    texts = [rl.tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
             for row, n in zip(batch["responses"], batch["response_mask"].sum(-1).tolist())]
    return [len(t) % 2 == 1 for t in texts]


def test_a_reward_function_returning_none_is_counted_per_data_source_and_warned_once(rl, tmp_path):
    module = tmp_path / "flaky_reward.py"
    module.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return None if len(solution_str) % 2 else 1.0\n")
    rl.update("reward.kind=function", f"reward.function={module}:compute_score", f"dataflow={FLOW}")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = rl.step(), rl.step()
    said = [str(w.message) for w in caught if "reward function failed" in str(w.message)]
    assert len(said) == 1 and "of 'arith'" in said[0] and "NoneType None, not a number" in said[0]  # once
    for result in (first, second):
        b = result.batch
        odd = sum(odd_lengths(rl, b))  # the samples the function answered None for
        assert odd > 0 and result.metrics["reward/errors/arith"] == result.metrics["reward/errors"] == odd
        assert float(b["token_level_scores"].sum()) == len(b) - odd  # 1.0 each, error_score 0 for the rest


def test_a_hanging_reward_function_is_cut_off_in_the_reward_worker(rl, tmp_path):
    module = tmp_path / "slow_reward.py"
    module.write_text("import time\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if len(solution_str) % 2:\n"
                      "        time.sleep(3600)\n"
                      "    return 1.0\n")
    rl.update("reward.kind=function", f"reward.function={module}:compute_score", "reward.timeout_s=4",
              f"dataflow={FLOW}")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rl.step()  # the step completes: the hung samples are cut off and counted
    b = result.batch
    # one reward worker scores the batch in order in a child process: the first call that hangs is cut
    # off at the time-out with every sample after it (each counted), those before it scored 1.0
    first = odd_lengths(rl, b).index(True)
    assert result.metrics["reward/errors"] == result.metrics["reward/errors/arith"] == len(b) - first
    assert b["token_level_scores"].sum(-1).tolist() == [1.0] * first + [0.0] * (len(b) - first)
