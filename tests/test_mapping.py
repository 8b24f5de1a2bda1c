"""Device mappings: parsed from YAML, validated with errors that say exactly what is wrong."""
import pytest

from hybridlab.controller.mapping import DeviceMapping, MappingError

GOOD = """
pools:
  train: {devices: 2}
  gen: {devices: 2, strategy: SPREAD}
roles:
  actor:   {pool: train, tp: 2, colocate: hybrid}
  ref:     {pool: train, tp: 2, colocate: hybrid}
  critic:  {pool: train, dp: 2}
  rollout: {pool: gen, dp: 2}
"""
MODEL = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3}


def test_yaml_round_trip_and_structure():
    m = DeviceMapping.from_yaml(GOOD).validate(model=MODEL, cluster_gpus=4)
    assert DeviceMapping.from_yaml(m.to_yaml()) == m
    assert m.process_sets() == [("train", ("actor", "ref")), ("train", ("critic",)), ("gen", ("rollout",))]
    assert m.colocation_groups() == {"hybrid": ["actor", "ref"]}


@pytest.mark.parametrize("change,message", [
    ("actor:   {pool: train, tp: 2, colocate: hybrid}\n  actor:   {pool: train, dp: 2}",
     "'actor' appears twice"),
    ("rollout: {pool: gen, dp: 2}", None),
    ("rollout: {pool: gpu, dp: 2}", "roles.rollout.pool: no pool named 'gpu'; pools are: train, gen"),
    ("rollout: {pool: gen, dp: 3}", "roles.rollout: tp x pp x dp = 1x1x3 = 3, but pool 'gen' has 2 devices"),
    ("rollout: {pool: gen, tp: 3}", "roles.rollout.tp: the model's 4 attention heads are not divisible by tp=3"),
    ("rollout: {pool: gen, pp: 2}", "roles.rollout.pp: rollout does not use pipeline parallelism"),
    ("rollout: {pool: gen, dpp: 2}", "roles.rollout: unknown field(s) dpp; allowed: pool, tp, pp, dp, colocate, ep"),
    ("rollout: {pool: gen, dp: 0}", "roles.rollout.dp: must be a positive integer"),
    ("rollout: {pool: gen, dp: 2, colocate: hybrid}", "colocate 'hybrid': roles actor, ref, rollout share"),
    ("rollout: {pool: gen, dp: 2}\n  judge: {pool: gen, dp: 2}", "roles.judge: unknown role; roles are: actor"),
])
def test_invalid_mappings_name_the_problem(change, message):
    text = GOOD.replace("rollout: {pool: gen, dp: 2}", change) if "rollout" in change.split(":")[0] \
        else GOOD.replace("actor:   {pool: train, tp: 2, colocate: hybrid}", change)
    if message is None:
        DeviceMapping.from_yaml(text).validate(model=MODEL, cluster_gpus=4)
        return
    with pytest.raises(MappingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DeviceMapping.from_yaml(text).validate(model=MODEL, cluster_gpus=4)


def test_colocated_training_roles_must_share_their_layout():
    m = DeviceMapping.from_dict({"pools": {"p": {"devices": 4}},
                                 "roles": {"actor": {"pool": "p", "tp": 2, "dp": 2, "colocate": "e"},
                                           "ref": {"pool": "p", "dp": 4, "colocate": "e"},
                                           "rollout": {"pool": "p", "dp": 4, "colocate": "e"}}})
    assert m.problems() == ["colocate 'e': training roles in one process must share tp, pp and ep"
                            " (actor tp=2 pp=1 ep=1, ref tp=1 pp=1 ep=1)"]


def test_layer_and_kv_head_checks_and_device_count():
    m = DeviceMapping.from_dict({"pools": {"p": {"devices": 4}},
                                 "roles": {"actor": {"pool": "p", "tp": 4}, "rollout": {"pool": "p", "tp": 4}}})
    problems = m.problems(model=MODEL, cluster_gpus=2)
    assert "roles.actor.tp: the model's 2 key/value heads are not divisible by tp=4" in problems
    assert not any(p.startswith("roles.rollout.tp") for p in problems)  # vLLM replicates KV heads
    assert "too few devices: the pools need 4 devices, the cluster has 2 GPUs" in problems
    pp = DeviceMapping.from_dict({"pools": {"p": {"devices": 2}}, "roles": {"actor": {"pool": "p", "pp": 2}}})
    assert pp.problems(model=MODEL) == ["roles.actor.pp: the model's 3 layers are not divisible by pp=2"]


def test_changed_roles_include_colocated_partners_and_pool_sharers():
    old = DeviceMapping.from_yaml(GOOD)
    assert old.changed_roles(old) == set()
    new = DeviceMapping.from_yaml(GOOD.replace("critic:  {pool: train, dp: 2}", "critic:  {pool: train, tp: 2}"))
    assert new.changed_roles(old) == {"critic"}
    new = DeviceMapping.from_yaml(GOOD.replace("ref:     {pool: train, tp: 2, colocate: hybrid}",
                                               "ref:     {pool: train, dp: 2, colocate: hybrid}"))
    assert old.changed_roles(new) == {"actor", "ref"}
    # Dropping the critic changes how the train pool's devices are shared.
    data = old.to_dict()
    del data["roles"]["critic"]
    assert old.changed_roles(DeviceMapping.from_dict(data)) == {"actor", "ref", "critic"}


def test_expert_parallelism_is_checked_against_the_roles_dp_and_the_models_experts():
    moe = {**MODEL, "num_experts": 6}
    mapping = lambda actor, rollout=None: DeviceMapping.from_dict(  # noqa: E731
        {"pools": {"p": {"devices": 4}}, "roles": {"actor": {"pool": "p", **actor},
                                                   **({"rollout": {"pool": "p", **rollout}} if rollout else {})}})
    assert mapping({"dp": 4, "ep": 2}).problems(model=moe) == []
    assert "ep" not in mapping({"dp": 4}).to_dict()["roles"]["actor"]  # dense runs' YAML is unchanged
    assert mapping({"dp": 2, "tp": 2, "ep": 4}).problems() == [
        "roles.actor.ep: ep=4 must divide dp=2 (expert-parallel ranks are data-parallel ranks that share out the"
        " experts)"]
    assert mapping({"dp": 4, "ep": 4}).problems(model=moe) == [
        "roles.actor.ep: the model's 6 experts are not divisible by ep=4"]
    assert mapping({"dp": 4, "ep": 2}).problems(model=MODEL) == [
        "roles.actor.ep: ep=2, but the model has no routed experts (expert parallelism splits them)"]
    assert mapping({"dp": 4}, {"dp": 4, "ep": 2}).problems() == [
        "roles.rollout.ep: only training roles (actor, ref, critic) use expert parallelism; set ep: 1"]
    assert mapping({"dp": 4, "ep": 0}).problems() == ["roles.actor.ep: must be a positive integer, got 0"]


def test_node_labels_pin_a_pool_and_travel_with_the_mapping():
    from hybridlab.controller.mapping_drawing import draw
    from hybridlab.explain import draw_mapping

    data = {"pools": {"train": {"devices": 1}, "gen": {"devices": 1, "node_labels": {"hybridlab/node": "gen"}}},
            "roles": {"actor": {"pool": "train"}, "rollout": {"pool": "gen"}}}
    mapping = DeviceMapping.from_yaml(DeviceMapping.from_dict(data).to_yaml())
    assert mapping.pools["gen"].node_labels == {"hybridlab/node": "gen"} and mapping.pools["train"].node_labels is None
    assert mapping.to_dict()["pools"] == {"train": {"devices": 1, "strategy": "PACK", "cpus_per_device": 1.0},
                                          "gen": {"devices": 1, "strategy": "PACK", "cpus_per_device": 1.0,
                                                  "node_labels": {"hybridlab/node": "gen"}}}
    assert mapping.problems() == []
    moved = DeviceMapping.from_dict({**data, "pools": {**data["pools"], "gen": {"devices": 1}}})
    assert moved.pools["gen"] != mapping.pools["gen"]  # a label change is a changed pool: a remap re-creates it
    assert "pool gen (1 device, on nodes labelled hybridlab/node=gen):" in draw_mapping(mapping)
    assert "<b>gen</b> on nodes labelled hybridlab/node=gen" in draw(mapping)
    for bad in ({}, {"hybridlab/node": ""}, ["gen"]):
        wrong = DeviceMapping.from_dict({**data, "pools": {**data["pools"], "gen": {"devices": 1, "node_labels": bad}}})
        assert wrong.problems() == ["pools.gen.node_labels: must map label names to values (strings), e.g."
                                    f" {{\"hybridlab/node\": \"gen\"}}, got {bad!r}"]
