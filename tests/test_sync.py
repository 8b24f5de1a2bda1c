"""Weight sync from the Megatron actor into vLLM engines, colocated and separate."""
import pytest
import torch

from hybridlab.controller.calls import WorkerError
from hybridlab.controller.group import RoleClass
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.evaluate import load_hf
from hybridlab.models.spec import ModelSpec
from hybridlab.protocol import Batch
from hybridlab.reshard.plan import RolloutLayout, TrainerLayout, buckets
from hybridlab.reshard.transfer import sync_weights
from hybridlab.tasks import get_task
from hybridlab.workers.rollout.worker import RolloutWorker
from hybridlab.workers.train import checkpoint
from hybridlab.workers.train.workers import ActorWorker
from tests.train_settings import train_settings

GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def data(trained_dir):
    from hybridlab.batching import sequences_batch

    _, tok = load_hf(trained_dir)
    samples = get_task("arith").split("train", 16, seed=5)
    prompts = [tok(s.prompt, add_special_tokens=False).input_ids for s in samples]
    answers = [tok(s.answer, add_special_tokens=False).input_ids + [2] for s in samples]
    test = get_task("arith").split("test", 16)
    return (sequences_batch(prompts, answers, pad_id=0),
            Batch(objects={"prompt_ids": [tok(s.prompt, add_special_tokens=False).input_ids for s in test]}))


def hf_greedy(state_dir, prompts):
    return RolloutWorker(str(state_dir), backend="hf", max_model_len=64).generate(prompts, GREEDY)["responses"]


def test_colocated_sync_after_a_step_matches_transformers(ray_local, trained_dir, data, tmp_path):
    train_batch, prompts = data
    mapping = DeviceMapping.from_dict({"pools": {"p": {"devices": 2}},
                                       "roles": {"actor": {"pool": "p", "dp": 2, "colocate": "hybrid"},
                                                 "rollout": {"pool": "p", "dp": 2, "colocate": "hybrid"}}})
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=str(trained_dir), settings=train_settings(lr=3e-3))),
             "rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=str(trained_dir), max_model_len=64))}
    spec = ModelSpec.from_hf(trained_dir)
    with WorkerSet(mapping, roles, timeout=300) as s:
        actor, rollout = s.groups["actor"], s.groups["rollout"]
        before = rollout.generate(prompts, GREEDY)["responses"]
        for _ in range(3):
            actor.sft_step(train_batch)
        report = sync_weights(actor, rollout, spec, TrainerLayout(dp=2), RolloutLayout(replicas=2), bucket_mb=0.3)
        after = rollout.generate(prompts, GREEDY)["responses"]
        reference = hf_greedy(checkpoint.export_hf(actor, trained_dir, tmp_path / "stepped"), prompts)
    # The largest fused group (gate + up of a layer) is 256 KiB: every bucket stays under 0.3 MiB.
    assert report.mode == "colocated" and report.buckets == len(buckets(spec, int(0.3 * 2**20))) > 8
    assert report.max_bucket_bytes <= 0.3 * 2**20
    assert torch.equal(after, reference)
    assert not torch.equal(after, before)   # the steps changed what the engine generates


def test_separate_sync_survives_a_trainer_layout_change(ray_local, trained_dir, data, tmp_path):
    train_batch, prompts = data
    layout = {"pools": {"train": {"devices": 2}, "gen": {"devices": 1}},
              "roles": {"actor": {"pool": "train", "tp": 2}, "rollout": {"pool": "gen"}}}
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=str(trained_dir),
                                                         settings=train_settings(lr=3e-3), tp=2)),
             "rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=str(trained_dir), max_model_len=64))}
    spec = ModelSpec.from_hf(trained_dir)
    with WorkerSet(DeviceMapping.from_dict(layout), roles, timeout=300) as s:
        for _ in range(3):
            s.groups["actor"].sft_step(train_batch)
        report = sync_weights(s.groups["actor"], s.groups["rollout"], spec, TrainerLayout(tp=2), RolloutLayout())
        first = s.groups["rollout"].generate(prompts, GREEDY)["responses"]
        saved = checkpoint.save_checkpoint(s.groups["actor"], trained_dir, tmp_path / "ckpt")
        assert torch.equal(first, hf_greedy(saved, prompts))
        assert report.mode == "separate" and report.bytes_moved == report.plan["total_bytes"]
        # each TP rank sent only its own slices, exactly the planner's pieces
        assert report.bytes_per_pair == report.plan["bytes_per_pair"] and set(report.bytes_per_pair) == {"0->0", "1->0"}

        # Same weights, new trainer layout (TP1 x DP2): only the actor is re-created.
        s.role_classes["actor"] = RoleClass(ActorWorker, kwargs=dict(model_dir=str(saved),
                                                                     settings=train_settings(lr=3e-3)))
        layout["roles"]["actor"] = {"pool": "train", "dp": 2}
        assert s.remap(DeviceMapping.from_dict(layout)) == {"actor"}
        s.groups["rollout"].load_weights(sorted(checkpoint_state_of(trained_dir).items()))   # scramble back
        sync_weights(s.groups["actor"], s.groups["rollout"], spec, TrainerLayout(dp=2), RolloutLayout())
        assert torch.equal(s.groups["rollout"].generate(prompts, GREEDY)["responses"], first)

        # An engine crash is named; the rollout is re-created and re-synced.
        import ray
        ray.kill(s.groups["rollout"].hostset.hosts[0])
        with pytest.raises(WorkerError) as crash:
            s.groups["rollout"].generate(prompts, GREEDY)
        assert crash.value.kind == "died" and crash.value.role == "rollout"
        s.recreate("rollout")
        sync_weights(s.groups["actor"], s.groups["rollout"], spec, TrainerLayout(dp=2), RolloutLayout())
        assert torch.equal(s.groups["rollout"].generate(prompts, GREEDY)["responses"], first)


def checkpoint_state_of(model_dir):
    from hybridlab.workers.train.convert import load_hf_state

    return load_hf_state(model_dir)
