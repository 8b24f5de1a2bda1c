"""The resharding planner: every rollout rank gets exactly its shard, from ranks that hold it."""
import pytest

from hybridlab.errors import UserError
from hybridlab.models.spec import ModelSpec
from hybridlab.reshard.plan import ReshardPlan, RolloutLayout, TrainerLayout, hf_shapes, plan_reshard, split_dim

SPEC = ModelSpec(arch="qwen2", vocab_size=320, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32,
                 intermediate=256, eps=1e-6, rope_theta=1e4, tied=True, qkv_bias=True, max_positions=512)


def coverage(plan: ReshardPlan, dst: int) -> dict[str, list[tuple[int, int]]]:
    out = {}
    for p in sorted((p for p in plan.pieces if p.dst == dst), key=lambda p: (p.name, p.start)):
        out.setdefault(p.name, []).append((p.start, p.stop))
    return out


def held_by(trainer: TrainerLayout, rank: int, name: str) -> tuple[int, int, int]:
    """(tp, pp, dp) coordinates of a trainer rank."""
    tp = rank % trainer.tp
    dp = (rank // trainer.tp) % trainer.dp
    pp = rank // (trainer.tp * trainer.dp)
    return tp, pp, dp


def test_tp2_pp2_to_two_tp1_replicas_sends_the_whole_model_to_each():
    trainer, rollout = TrainerLayout(tp=2, pp=2), RolloutLayout(tp=1, replicas=2)
    plan = plan_reshard(SPEC, trainer, rollout)
    model_bytes = sum(4 * __import__("math").prod(s) for s in hf_shapes(SPEC).values())
    for dst in (0, 1):
        assert plan.bytes_to(dst) == model_bytes
        for name, ranges in coverage(plan, dst).items():
            size = hf_shapes(SPEC)[name][max(split_dim(name), 0)]
            assert ranges[0][0] == 0 and ranges[-1][1] == size                       # starts and ends
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), name      # no gap, no overlap
    # Layer 3 lives on the second stage: its pieces come from ranks 2 and 3 (pp=1).
    srcs = {p.src for p in plan.pieces if p.name.startswith("model.layers.3.")}
    assert srcs == {2, 3}
    assert {held_by(trainer, p.src, p.name)[1] for p in plan.pieces if p.name == "model.layers.0.mlp.up_proj.weight"} == {0}


def test_dp2_to_tp2_takes_halves_from_both_trainer_shards():
    trainer, rollout = TrainerLayout(tp=1, dp=2), RolloutLayout(tp=2, replicas=1)
    plan = plan_reshard(SPEC, trainer, rollout)
    q = [p for p in plan.pieces if p.name == "model.layers.0.self_attn.q_proj.weight"]
    assert [(p.dst, p.src, p.start, p.stop) for p in q] == [(0, 0, 0, 64), (1, 0, 64, 128)]
    down = [p for p in plan.pieces if p.name == "model.layers.0.mlp.down_proj.weight"]
    assert [(p.dst, p.dim, p.start, p.stop) for p in down] == [(0, 1, 0, 128), (1, 1, 128, 256)]
    norm = [p for p in plan.pieces if p.name == "model.norm.weight"]
    assert [(p.dst, p.dim, p.nbytes) for p in norm] == [(0, -1, 512), (1, -1, 512)]
    assert plan.summary()["bytes_to_rollout_rank"][0] == plan.bytes_to(0)


def test_replicas_spread_over_dp_and_tp_finer_than_kv_heads_replicates_them():
    plan = plan_reshard(SPEC, TrainerLayout(tp=1, dp=2), RolloutLayout(tp=4, replicas=2))
    assert {p.src for p in plan.pieces if p.dst < 4} == {0} and {p.src for p in plan.pieces if p.dst >= 4} == {1}
    k = [(p.dst, p.start, p.stop) for p in plan.pieces if p.name == "model.layers.0.self_attn.k_proj.weight" and p.dst < 4]
    assert k == [(0, 0, 32), (1, 0, 32), (2, 32, 64), (3, 32, 64)]   # 2 KV heads over 4 ranks


def test_whole_tensor_plan_gives_every_engine_rank_every_byte_from_the_trainer_shards():
    trainer, rollout = TrainerLayout(tp=2), RolloutLayout(tp=2, replicas=1)
    plan = plan_reshard(SPEC, trainer, rollout, whole=True)
    model_bytes = sum(4 * __import__("math").prod(shape) for shape in hf_shapes(SPEC).values())
    assert plan.bytes_to(0) == plan.bytes_to(1) == model_bytes and plan.summary()["whole_tensors"]
    q = [(p.dst, p.src, p.start, p.stop) for p in plan.pieces if p.name == "model.layers.0.self_attn.q_proj.weight"]
    assert q == [(0, 0, 0, 64), (0, 1, 64, 128), (1, 0, 0, 64), (1, 1, 64, 128)]  # both halves to both ranks
    sharded = plan_reshard(SPEC, trainer, rollout)
    assert sharded.total_bytes < plan.total_bytes


def test_a_trainer_layout_that_cannot_split_is_refused():
    with pytest.raises(UserError, match=r"^cannot split this qwen2 model as tp=1, pp=3: 4 layers are not divisible"
                                        r" by pp=3$"):
        plan_reshard(SPEC, TrainerLayout(pp=3), RolloutLayout())


def test_buckets_respect_the_limit_and_keep_fused_groups_together():
    from hybridlab.reshard.plan import buckets

    limit = 300 * 1024
    groups = buckets(SPEC, limit)
    shapes = hf_shapes(SPEC)
    assert sorted(n for g in groups for n in g) == sorted(shapes)
    assert all(sum(4 * __import__("math").prod(shapes[n]) for n in g) <= limit for g in groups)
    for g in groups:
        for layer in range(SPEC.layers):
            p = f"model.layers.{layer}."
            for fused in (["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                          ["mlp.gate_proj.weight", "mlp.up_proj.weight"]):
                present = [p + f in g for f in fused]
                assert all(present) or not any(present)


def test_a_layers_experts_share_one_bucket():
    """vLLM holds a layer's experts in one fused tensor that a reload re-creates whole: experts
    loaded in two calls lose the first call's (the engine then generated only token 0)."""
    from hybridlab.models.zoo import model_config
    from hybridlab.reshard.plan import buckets

    spec = ModelSpec.from_hf(model_config("tiny", "qwen3moe"))
    expert_bytes = 3 * 64 * 128 * 4
    groups = buckets(spec, expert_bytes)  # a limit of one expert: each layer's group still holds all four
    shapes = hf_shapes(spec)
    assert sorted(n for g in groups for n in g) == sorted(shapes)
    for layer in spec.moe.sparse_layers:
        holding = [g for g in groups if any(n.startswith(f"model.layers.{layer}.mlp.experts.") for n in g)]
        assert len(holding) == 1 and sum(".mlp.experts." in n for n in holding[0]) == 4 * 3
