"""Live device-mapping edits on a running RL session, on the real engines (tiny model): the
trainer's state survives bit for bit, a seeded run with a same-layout remap repeats the run
without it, a TP change keeps log-probs and losses within 1e-5, bad remaps change nothing,
and settings built into workers apply live or re-create only their role."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import ray
import torch

from hybridlab.config import ConfigError
from hybridlab.dataflow.remap_checks import parse_mapping
from hybridlab.dataflow.session import RLSession
from hybridlab.workers.train.checkpoint import merge_state

SETTINGS = ["warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6",
            "actor.ppo_mini_batch_size=8", "data.test_samples=16", "trainer.progress=false"]
SEPARATE = """
pools: {train: {devices: 1}, gen: {devices: 1}}
roles:
  actor: {pool: train}
  rollout: {pool: gen, colocate: g}
  reward: {pool: gen, colocate: g}
"""
ACTOR_TP2 = {"pools": {"train": {"devices": 2}, "gen": {"devices": 1}},
             "roles": {"actor": {"pool": "train", "tp": 2},
                       "rollout": {"pool": "gen", "colocate": "g"}, "reward": {"pool": "gen", "colocate": "g"}}}
ROLLOUT_DP2 = {"pools": {"train": {"devices": 2}, "gen": {"devices": 2}},
               "roles": {"actor": {"pool": "train", "dp": 2},
                         "rollout": {"pool": "gen", "dp": 2, "colocate": "g"},
                         "reward": {"pool": "gen", "dp": 2, "colocate": "g"}}}
ROLLOUT_TP2 = {"pools": {"train": {"devices": 2}, "gen": {"devices": 2}},
               "roles": {"actor": {"pool": "train", "dp": 2},
                         "rollout": {"pool": "gen", "tp": 2, "colocate": "g"},
                         "reward": {"pool": "gen", "dp": 2, "colocate": "g"}}}
HYBRID_TP2 = {"pools": {"main": {"devices": 2}},
              "roles": {"actor": {"pool": "main", "tp": 2, "colocate": "e"},
                        "rollout": {"pool": "main", "tp": 2, "colocate": "e"},
                        "reward": {"pool": "main", "dp": 2, "colocate": "e"}}}
COLOCATED = {"pools": {"main": {"devices": 1}},
             "roles": {r: {"pool": "main", "colocate": "engine"} for r in ("actor", "rollout", "reward")}}


def repeatable(metrics: dict) -> dict:
    """A step's metrics without what measures time or bytes moved (the rest must repeat)."""
    return {k: v for k, v in metrics.items()
            if not k.startswith(("timing/", "perf/", "sync/")) and k != "warnings"}


def actor_state(rl) -> dict:
    """The actor's weights and AdamW moments in HF layout, merged over pipeline stages."""
    parts = rl.workers.groups["actor"].checkpoint_state()
    out = {f"{key}/{name}": t for key, named in merge_state(parts).items() for name, t in named.items()}
    out["step"] = torch.tensor(next(p for p in parts if p)["step"])
    return out


def on_layout(rl, mapping) -> None:
    """Remap ``rl`` to ``mapping`` unless it runs on it already. Each test starts from the layout
    it needs: the one the test before it leaves (no remap then), or, run alone, this remap."""
    if rl.mapping != parse_mapping(mapping):
        rl.remap(mapping)


def assert_equal_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} changed across the remap"


@pytest.fixture(scope="module")
def reference(ray_local, trained_dir, tmp_path_factory):
    """Per-step metrics of the seeded run without any remap (4 steps, colocated on 1 device)."""
    run = RLSession(None, [f"model={trained_dir}", *SETTINGS,
                           f"trainer.run_dir={tmp_path_factory.mktemp('ref') / 'run'}"]).start()
    try:
        return [run.step().metrics for _ in range(4)]
    finally:
        run.shutdown()


@pytest.fixture(scope="module")
def rl(ray_local, trained_dir, tmp_path_factory):
    # Two warmed-up spare processes: every remap below builds its new workers in them (the
    # reference run has none, so the bit-for-bit test also holds spares against new processes).
    session = RLSession(None, [f"model={trained_dir}", *SETTINGS, "trainer.spare_processes=2",
                               f"trainer.run_dir={tmp_path_factory.mktemp('remap') / 'run'}"]).start()
    yield session
    session.shutdown()


def test_same_layout_remap_keeps_state_and_the_run_bit_for_bit(rl, reference):
    assert rl.state.step_count == 0 and rl.cfg.mapping is None  # the module's session as started: first in the module
    steps = [rl.step().metrics for _ in range(2)]
    before = actor_state(rl)
    pids = {p["pid"] for p in rl.workers.groups["actor"].placements}
    assert rl.workers.spares.wait_ready(timeout=300) == 2
    spare_pids = {ray.get(s.warmed)["pid"] for s in rl.workers.spares.spares}
    report = rl.remap(SEPARATE)  # YAML text; colocated on one device -> actor | rollout + reward
    assert_equal_state(before, actor_state(rl))
    assert report.roles_recreated == ["actor", "reward", "rollout"]
    assert (report.processes_started, report.processes_stopped, report.spares_used) == (2, 1, 2)
    placed = {g: rl.workers.groups[g].placements[0] for g in ("actor", "rollout")}
    assert {p["pid"] for p in placed.values()} == spare_pids  # the new workers are the spares
    assert placed["actor"]["gpu_ids"] != placed["rollout"]["gpu_ids"]  # each took its pool's device
    assert len(rl.workers.spares.spares) == 2 and not spare_pids & {
        ray.get(s.warmed)["pid"] for s in rl.workers.spares.spares}  # used ones replaced by new ones
    assert report.step == 2 and report.bytes_moved > 3 * 4 * 600_000  # weights + two moments, fp32
    assert not pids & {p["pid"] for p in rl.workers.groups["actor"].placements}
    assert rl.workers.groups["actor"].hostset is not rl.workers.groups["rollout"].hostset
    steps += [rl.step().metrics for _ in range(1)]
    assert [repeatable(m) for m in steps] == [repeatable(m) for m in reference[:3]]
    logged = [json.loads(line) for line in (rl.run_dir / "remaps.jsonl").read_text().splitlines()]
    assert logged[-1]["roles_recreated"] == report.roles_recreated
    assert logged[-1]["mapping_after"]["pools"] == {"train": {"devices": 1, "strategy": "PACK",
                                                              "cpus_per_device": 1.0},
                                                    "gen": {"devices": 1, "strategy": "PACK", "cpus_per_device": 1.0}}


def fixed_batch(rl):
    """Responses sampled by the rollout from the weights it holds now (test prompts, fixed seed), at
    the temperature the actor scores them with."""
    from hybridlab.dataflow.prompts import prompt_batch

    prompts = prompt_batch(rl.test_samples[:8], rl.tokenizer, list(range(8)))
    return rl.workers.groups["rollout"].generate(prompts, {"n": 2, "temperature": rl.cfg.rollout.temperature,
                                                           "max_tokens": 6, "seed": 123})


def assert_steps_in_sync(rl) -> None:
    """Take a step on the session's current mapping and check its numbers: the reward logged is its
    batch's, and afterwards the rollout samples what the actor scores (the step's sync landed)."""
    result = rl.step()
    scores = result.batch["token_level_scores"].sum(-1)
    assert result.metrics["reward/mean"] == pytest.approx(float(scores.mean()))
    assert math.isfinite(result.metrics["actor/pg_loss"])
    batch = fixed_batch(rl)
    actor = rl.workers.groups["actor"].compute_log_prob(batch)["old_log_probs"]
    mask = batch["response_mask"].bool()
    assert mask.any() and (actor - batch["rollout_log_probs"])[mask].abs().max() < 1e-4


def test_actor_tp_1_to_2_keeps_log_probs_and_the_next_loss_within_1e5(rl, reference):
    if rl.state.step_count == 0:  # run alone: where the test above leaves the seeded run (3 steps, actor | rollout)
        on_layout(rl, SEPARATE)  # a remap keeps the run bit for bit (the test above)
        for _ in range(3):
            rl.step()
    assert rl.state.step_count == 3 and rl.mapping == parse_mapping(SEPARATE)
    batch = fixed_batch(rl)
    log_probs = rl.workers.groups["actor"].compute_log_prob(batch)["old_log_probs"]
    mask = batch["response_mask"].bool()
    assert (log_probs - batch["rollout_log_probs"])[mask].abs().max() < 1e-4  # the remap's sync landed
    before = actor_state(rl)
    report = rl.remap(ACTOR_TP2)
    assert report.roles_recreated == ["actor"]  # the rollout's processes stay
    assert_equal_state(before, actor_state(rl))  # resharded exactly, gathered back exactly
    after = rl.workers.groups["actor"].compute_log_prob(batch)["old_log_probs"]
    assert (after - log_probs)[mask].abs().max() <= 1e-5
    step4 = rl.step().metrics
    same = {k for k in repeatable(reference[3]) if k.startswith(("reward/", "response_length/"))}
    assert same and {k: step4[k] for k in same} == {k: reference[3][k] for k in same}  # same samples
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert step4[key] == pytest.approx(reference[3][key], abs=1e-5, rel=1e-5)


def test_rollout_dp_1_to_2_fed_by_two_trainer_dp_ranks_on_resized_pools(rl):
    on_layout(rl, ACTOR_TP2)
    before = actor_state(rl)
    report = rl.remap(ROLLOUT_DP2)  # actor TP 2 -> DP 2, rollout 1 -> 2 replicas, gen pool 1 -> 2 devices
    assert report.roles_recreated == ["actor", "reward", "rollout"]
    assert_equal_state(before, actor_state(rl))
    assert rl.workers.groups["rollout"].world_size == 2
    batch = fixed_batch(rl)  # split over the two replicas
    actor = rl.workers.groups["actor"].compute_log_prob(batch)["old_log_probs"]
    mask = batch["response_mask"].bool()
    assert mask.sum() > 16 and (actor - batch["rollout_log_probs"])[mask].abs().max() < 1e-4
    sync = rl.sync_weights()
    pairs = sync.plan["bytes_per_pair"]  # as planned: replica r from trainer DP rank r, nothing crosses
    assert set(pairs) == {"0->0", "1->1"} and pairs["0->0"] == pairs["1->1"] == sync.bytes_moved // 2
    assert sync.bytes_per_pair == pairs  # and as measured: the transfer ran its plan
    assert_steps_in_sync(rl)


@pytest.mark.parametrize("pair,reason", [
    ("model=small", "model cannot change in a running session: every role's weights start from it"),
    ("data.task=reverse", "data.task cannot change in a running session: the prompt stream"),
    ("trainer.seed=3", "trainer.seed cannot change in a running session"),
    ("trainer.devices=2", "trainer.devices sizes the default mapping, but this session has an explicit one"),
])
def test_what_would_make_another_run_is_refused_with_the_reason(rl, pair, reason):
    if rl.cfg.mapping is None:  # run alone: the same placement written out makes the mapping explicit
        rl.update(f"mapping={json.dumps(rl.mapping.to_dict())}")
    assert rl.cfg.mapping is not None
    with pytest.raises(ConfigError, match=reason):
        rl.update(pair)


def test_bad_remaps_are_refused_naming_the_role_and_nothing_changes(rl):
    mapping = rl.mapping
    pids = sorted(p["pid"] for s in rl.workers._sets for p in s.placements)
    bad = [
        ({"pools": {"main": {"devices": 3}}, "roles": {r: {"pool": "main", "tp": 3 if r == "actor" else 1,
                                                           "dp": 1 if r == "actor" else 3}
                                                       for r in ("actor", "rollout", "reward")}},
         "roles.actor.tp: the model's 4 attention heads are not divisible by tp=3"),
        ({"pools": {"main": {"devices": 8}}, "roles": {r: {"pool": "main", "dp": 8, "colocate": "e"}
                                                       for r in ("actor", "rollout", "reward")}},
         "the pools need 8 devices, the cluster has 4"),
        ({"pools": {"main": {"devices": 3}}, "roles": {"actor": {"pool": "main", "dp": 3},
                                                       "rollout": {"pool": "main", "tp": 3},
                                                       "reward": {"pool": "main", "dp": 3}}},
         "roles.rollout.tp: the model's 4 attention heads are not divisible by tp=3"),
        ({"pools": {"main": {"devices": 1}}, "roles": {"actor": {"pool": "main"}, "rollout": {"pool": "main"}}},
         "dataflow[1] reward: runs on role 'reward', which the device mapping does not have (roles: actor, rollout)"),
    ]
    for new, message in bad:
        with pytest.raises(ConfigError, match="this remap cannot run; the session keeps its mapping") as err:
            rl.remap(new)
        assert message in str(err.value), str(err.value)
    assert rl.mapping == mapping
    assert sorted(p["pid"] for s in rl.workers._sets for p in s.placements) == pids
    assert_steps_in_sync(rl)  # still training on the old mapping


def test_live_settings_apply_to_running_workers_without_restarts(rl):
    pids = sorted(p["pid"] for s in rl.workers._sets for p in s.placements)
    remaps = len(rl.state.remaps)
    rl.update("actor.lr=5e-5", "actor.warmup_steps=0", "actor.grad_clip=0.5", "actor.micro_batch_size=16",
              "rollout.temperature=0.9")
    for settings in rl.workers.groups["actor"].settings():
        assert settings["micro_batch_size"] == 16 and settings["temperature"] == 0.9
        assert settings["optim"]["lr"] == 5e-5 and settings["optim"]["grad_clip"] == 0.5
        assert settings["optim"]["warmup_steps"] == 0
    assert sorted(p["pid"] for s in rl.workers._sets for p in s.placements) == pids and len(rl.state.remaps) == remaps
    metrics = rl.step().metrics
    assert metrics["actor/lr"] == pytest.approx(5e-5)


def test_the_number_of_spares_changes_live_and_a_bad_one_is_refused_by_name(rl):
    with pytest.raises(ConfigError, match=r"trainer.spare_processes: must be at least 0, got -1"):
        rl.update("trainer.spare_processes=-1")
    assert len(rl.workers.spares.spares) == 2 and rl.cfg.trainer.spare_processes == 2
    rl.update("trainer.spare_processes=1")
    assert len(rl.workers.spares.spares) == 1
    rl.update("trainer.spare_processes=2")
    assert len(rl.workers.spares.spares) == 2


def test_a_setting_built_into_the_rollout_re_creates_only_its_processes(rl):
    if rl.workers.groups["actor"].hostset is rl.workers.groups["rollout"].hostset:
        on_layout(rl, SEPARATE)  # run alone: the actor in processes of its own
    assert rl.cfg.rollout.kv_cache_mb != 32
    actor_pids = {p["pid"] for p in rl.workers.groups["actor"].placements}
    before = actor_state(rl)
    rl.update("rollout.kv_cache_mb=32")
    report = rl.state.remaps[-1]
    assert report.reason == "update" and report.roles_recreated == ["reward", "rollout"]
    assert {p["pid"] for p in rl.workers.groups["actor"].placements} == actor_pids
    assert_equal_state(before, actor_state(rl))
    assert_steps_in_sync(rl)


def vllm_has_shm_communicator() -> bool:
    """Whether this machine's vLLM CPU kernels (the build vLLM picks for the processor) include
    the shared-memory communicator that TP > 1 engines then use."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, "init_shm_manager")


def engine_files(rl) -> set[str]:
    """The files the rollout engines say they keep outside their processes."""
    return {path for paths in rl.workers.groups["rollout"].engine_files() for path in paths}


def shm_mapped_by(role_pids) -> set[str]:
    """The files in /dev/shm that the processes ``role_pids`` hold mapped now (unlinked ones left out)."""
    found = set()
    for pid in role_pids:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and not fields[5].endswith(" (deleted)"):
                found.add(fields[5])
    return found


def test_rollout_tp_1_to_2_samples_what_tp_1_samples_separate_and_colocated(rl):
    on_layout(rl, ROLLOUT_DP2)  # run alone: two rollout replicas of tp 1 beside an actor of dp 2
    greedy = {"n": 1, "temperature": 0.0, "max_tokens": 6}
    from hybridlab.dataflow.prompts import prompt_batch

    prompts = prompt_batch(rl.test_samples[:8], rl.tokenizer, list(range(8)))
    tp1 = rl.workers.groups["rollout"].generate(prompts, greedy)
    tp1_files = engine_files(rl)
    assert len(tp1_files) == 2 and all(os.path.exists(p) for p in tp1_files)  # two replicas' rendezvous files
    before = actor_state(rl)
    shm_before = {os.path.join("/dev/shm", name) for name in os.listdir("/dev/shm")}
    report = rl.remap(ROLLOUT_TP2)  # 2 rollout replicas of tp 1 -> one engine of tp 2 on the same devices
    assert report.roles_recreated == ["reward", "rollout"] and rl.workers.groups["rollout"].dp_layout() == [
        (0, 1, True), (0, 1, False)]
    assert_equal_state(before, actor_state(rl))
    assert not any(os.path.exists(p) for p in tp1_files)  # the stopped engines removed theirs
    tp2 = rl.workers.groups["rollout"].generate(prompts, greedy)
    assert torch.equal(tp2["responses"], tp1["responses"])  # greedy: the same tokens
    assert (tp2["rollout_log_probs"] - tp1["rollout_log_probs"]).abs().max() <= 1e-5
    sync = rl.sync_weights()  # whole tensors to both ranks of the engine, from trainer DP rank 0
    assert sync.plan["whole_tensors"] and set(sync.bytes_per_pair) == {"0->0", "0->1"}
    assert sync.bytes_per_pair == sync.plan["bytes_per_pair"]
    assert sync.bytes_per_pair["0->0"] == sync.bytes_per_pair["0->1"] == sync.bytes_moved // 2
    tp2_files = engine_files(rl)
    # vLLM's CPU kernels have a shared-memory TP communicator only in their AVX-512 builds; the AVX2
    # build (processors without AVX-512) talks over torch.distributed and makes no segments.
    segments = 2 if vllm_has_shm_communicator() else 0
    assert len(tp2_files) == segments and all(p.startswith("/dev/shm/") and os.path.exists(p) for p in tp2_files)
    # What the TP=2 engine's two processes made in /dev/shm since the remap began, read from what
    # they hold mapped: in every build vLLM's TP broadcast ring buffer (multiprocessing's psm_*),
    # and in AVX-512 builds the communicator's segments, which the engine names itself (tp2_files).
    tp2_pids = [p["pid"] for p in rl.workers.groups["rollout"].placements]
    created = shm_mapped_by(tp2_pids) - shm_before
    assert created and tp2_files <= created, (created, tp2_files)
    rl.step()
    batch = fixed_batch(rl)  # sampled after the step's sync: the engine holds the updated weights
    actor = rl.workers.groups["actor"].compute_log_prob(batch)["old_log_probs"]
    mask = batch["response_mask"].bool()
    assert (actor - batch["rollout_log_probs"])[mask].abs().max() < 1e-4

    report = rl.remap(HYBRID_TP2)  # the hybrid engine: actor tp 2 and rollout tp 2 in the same processes
    assert rl.workers.groups["actor"].hostset is rl.workers.groups["rollout"].hostset
    assert not set(tp2_pids) & {p["pid"] for s in rl.workers._sets for p in s.placements}  # that engine stopped
    assert sorted(p for p in created if os.path.exists(p)) == []  # and every file it made in /dev/shm is gone
    batch = fixed_batch(rl)
    actor = rl.workers.groups["actor"].compute_log_prob(batch)["old_log_probs"]
    mask = batch["response_mask"].bool()
    assert (actor - batch["rollout_log_probs"])[mask].abs().max() < 1e-4
    assert rl.sync_weights().mode == "colocated"
    assert_steps_in_sync(rl)


def test_a_remap_during_a_background_run_lands_at_a_step_boundary(rl):
    if rl.mapping == parse_mapping(COLOCATED):
        on_layout(rl, SEPARATE)  # run alone: start from another layout, so the remap below moves roles
    start = rl.state.step_count
    run = rl.start_background(4)
    try:
        report = rl.remap(COLOCATED)
    finally:
        summary = run.wait(600)
    assert start <= report.step <= start + 4
    assert summary["steps"] == start + 4 and rl.workers.groups["actor"].hostset is rl.workers.groups["rollout"].hostset
    lines = [json.loads(line) for line in (rl.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "reward/mean" in line]
    assert steps == list(range(1, start + 5))  # no step lost or repeated around the remap


def test_adding_the_critic_then_moving_it_to_another_pool_carries_its_state(rl):
    assert "critic" not in rl.mapping.roles and rl.cfg.algorithm.adv_estimator != "gae"
    mapping = rl.mapping.to_dict()
    mapping["pools"]["c1"] = {"devices": 1}
    mapping["roles"]["critic"] = {"pool": "c1"}
    rl.update("algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8", f"mapping={json.dumps(mapping)}")
    report = rl.state.remaps[-1]
    assert report.roles_added == ["critic"] and report.roles_recreated == []  # nothing else restarted
    assert "values" in rl.dataflow.names and "critic/vf_loss" in rl.step().metrics
    parts = [p for p in rl.workers.groups["critic"].checkpoint_state() if p]
    mapping["pools"]["c2"] = mapping["pools"].pop("c1")
    mapping["roles"]["critic"] = {"pool": "c2"}
    report = rl.remap(mapping)
    assert report.roles_recreated == ["critic"] and rl.mapping.roles["critic"].pool == "c2"
    after = [p for p in rl.workers.groups["critic"].checkpoint_state() if p]
    for key in ("model", "exp_avg", "exp_avg_sq"):
        for name, tensor in parts[0][key].items():
            assert torch.equal(tensor, after[0][key][name]), f"critic {key}/{name} changed"
    assert after[0]["step"] == parts[0]["step"] == 1
    assert "critic/vf_loss" in rl.step().metrics
