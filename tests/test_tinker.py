"""The Tinker API served by hybridlab (``hybridlab serve tinker``), driven by the unchanged
``tinker`` SDK on loopback with the tiny zoo model.

One server serves the module. A reference copy of the adapter, trained in this process with
plain transformers + peft and torch's AdamW (``tests/tinker_reference.py``), follows every training call: the server's
log-probs and losses must equal it, which checks each loss's gradient and every optimizer step.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from transformers import AutoTokenizer

from hybridlab.errors import UserError
from hybridlab.tinker import routes
from hybridlab.tinker.adapters import ATTN
from hybridlab.tinker.losses import LOSSES
from hybridlab.tinker.server import TinkerServer
from hybridlab.tinker.settings import ServiceSettings

from tests.tinker_reference import (ADAM, ALPHA, RANK, SEED, Reference, assert_same_forward, datum,
                                    formula, level, rl_data)


@pytest.fixture(scope="module")
def server(ray_local, tiny_dir, tmp_path_factory):
    from huggingface_hub import constants

    hub = tmp_path_factory.mktemp("hub")  # where the served name's tokenizer is published, for this module
    settings = ServiceSettings(model=str(tiny_dir), run_dir=str(tmp_path_factory.mktemp("tinker")),
                               hub_cache=str(hub), max_lora_rank=8, lora_alpha=ALPHA, context=512, kv_cache_mb=32,
                               seed=SEED)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_CACHE", str(hub))  # what transformers reads at each load
        srv = TinkerServer(settings).start()
        yield srv
        srv.stop()


@pytest.fixture(scope="module")
def clients(server, tiny_dir):
    service = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
    training = service.create_lora_training_client(base_model=server.service.base_model, rank=RANK).result()
    yield service, training, Reference(tiny_dir)
    service.close("success")


def test_every_route_of_the_sdk_is_served_or_refused_by_name():
    sdk = Path(tinker.__file__).parent
    paths = set()
    for source in [*sdk.glob("resources/*.py"), *sdk.glob("lib/*.py"), *sdk.glob("lib/public_interfaces/*.py")]:
        paths |= set(re.findall(r'"/api/v1/([a-z_/{}]+)"', source.read_text()))
    served = {"client/config", "client/dynamic_config", "create_session", "session_heartbeat",
              "sessions/{session_id}/finish", "create_model", "get_info", "forward_backward", "optim_step",
              "save_weights", "save_weights_for_sampler", "load_weights", "create_sampling_session", "asample",
              "retrieve_future", "telemetry", "cancel_future", "get_server_capabilities", "healthz",
              "samplers/{sampler_id}", "samplers/{sampling_session_id}"}
    refused = set(routes.NOT_SERVED) | {p for p in paths if p.split("/")[0] in routes.REST_ONLY} - served
    assert paths - served - refused == set()  # a route a new SDK adds fails here until it is classified
    assert served <= paths  # and one it drops
    assert routes.HANDLERS.keys() == served - {"get_server_capabilities", "healthz", "samplers/{sampler_id}",
                                                 "samplers/{sampling_session_id}"}


def test_the_served_name_loads_its_tokenizer_offline_as_the_sdk_does(server, clients, tiny_dir):
    service, training, _ = clients
    assert server.service.base_model == f"hybridlab/{tiny_dir.name}"
    sampling = service.create_sampling_client(base_model=server.service.base_model).result()
    text = "12+7=19"
    want = AutoTokenizer.from_pretrained(str(tiny_dir)).encode(text)
    assert sampling.get_tokenizer().encode(text) == want  # by name, from the hub cache (HF_HUB_OFFLINE=1)
    assert training.get_tokenizer().encode(text) == want  # by get_info's tokenizer_id


def test_cross_entropy_rounds_lower_the_loss_and_equal_the_same_steps_done_directly(clients):
    _, training, reference = clients
    tokenizer = training.get_tokenizer()
    text = [tokenizer.encode(t) for t in ("12+7=19\n", "3+4=7\n")]
    data = [{"tokens": ids[:-1], "target_tokens": ids[1:], "weights": [0.0, *[1.0] * (len(ids) - 2)]}
            for ids in text]
    losses = []
    for _ in range(3):
        result = training.forward_backward([datum(d) for d in data], "cross_entropy").result()
        expected, value = reference.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(**ADAM)).result()
        reference.step()
        for out, want in zip(result.loss_fn_outputs, expected):
            np.testing.assert_allclose(out["logprobs"].to_numpy(), want.numpy(), atol=1e-5, rtol=0)
        assert result.metrics["loss:sum"] == pytest.approx(value, abs=1e-4)
        losses.append(result.metrics["loss:sum"])
    assert losses[0] > losses[1] > losses[2]


@pytest.mark.parametrize("loss", [name for name in LOSSES if name != "cross_entropy"])
def test_each_rl_loss_and_its_gradient_equal_the_formula(server, clients, loss):
    _, training, reference = clients
    level(server, training, reference)
    data = rl_data(reference, np.random.default_rng(len(loss)))
    config = {"beta": 0.3} if loss == "dro" else {"clip_low_threshold": 0.97, "clip_high_threshold": 1.02} \
        if loss in ("ppo", "cispo", "gspo") else None
    result = training.forward_backward([datum(d) for d in data], loss, loss_fn_config=config).result()
    expected, value = reference.forward_backward(data, loss, config)
    training.optim_step(types.AdamParams(**ADAM)).result()
    reference.step()
    assert result.metrics["loss:sum"] == pytest.approx(value, abs=1e-4)
    assert_same_forward(training, reference, data, atol=2e-5)


def test_a_custom_loss_trains_through_the_sdks_forward_and_weighted_cross_entropy(server, clients):
    _, training, reference = clients
    level(server, training, reference)
    data = rl_data(reference, np.random.default_rng(5))

    def squared(batch, logprobs):  # a nonlinear loss of the log-probs: the SDK differentiates it itself
        loss = sum((lp ** 2).sum() for lp in logprobs)
        return loss, {"squared": float(loss)}

    training.forward_backward_custom([datum(d) for d in data], squared).result()
    training.optim_step(types.AdamParams(**ADAM)).result()
    for d in data:
        (reference.logprobs(d["tokens"], d["target_tokens"]) ** 2).sum().backward()
    reference.step()
    assert_same_forward(training, reference, data, atol=2e-5)


def test_sampling_uses_exactly_the_saved_weights(server, clients):
    service, training, reference = clients
    level(server, training, reference)
    prompt = types.ModelInput.from_ints([21, 22, 15, 27])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=0)
    older = training.save_weights_and_get_sampling_client().result()
    with torch.no_grad():
        old_logprobs = reference.logprobs([21, 22, 15], [22, 15, 27])
    data = rl_data(reference, np.random.default_rng(7))
    training.forward_backward([datum(d) for d in data], "importance_sampling").result()
    reference.forward_backward(data, "importance_sampling")
    training.optim_step(types.AdamParams(**ADAM)).result()
    reference.step()
    newer = training.save_weights_and_get_sampling_client().result()
    sampled = newer.sample(prompt, num_samples=2, sampling_params=params).result()
    assert len(sampled.sequences) == 2
    for seq in sampled.sequences:
        scored = newer.compute_logprobs(types.ModelInput.from_ints([21, 22, 15, 27, *seq.tokens])).result()
        np.testing.assert_allclose(scored[4:], seq.logprobs, atol=1e-4, rtol=0)
        with torch.no_grad():
            want = reference.logprobs([21, 22, 15, 27, *seq.tokens[:-1]], [22, 15, 27, *seq.tokens])
        np.testing.assert_allclose(seq.logprobs, want[3:].numpy(), atol=1e-4, rtol=0)
    # the older client still samples from the weights it was saved with
    np.testing.assert_allclose(older.compute_logprobs(prompt).result()[1:], old_logprobs.numpy(), atol=1e-4)
    base = service.create_sampling_client(base_model=training.get_info().model_data.model_name).result()
    assert not np.allclose(base.compute_logprobs(prompt).result()[1:], old_logprobs.numpy(), atol=1e-3)


def test_a_state_saved_with_its_optimizer_continues_bit_for_bit_in_a_new_server(server, clients, tiny_dir,
                                                                                 tmp_path):
    service, training, reference = clients
    data = rl_data(reference, np.random.default_rng(11))
    training.forward_backward([datum(d) for d in data], "importance_sampling").result()  # moments to carry
    training.optim_step(types.AdamParams(**ADAM)).result()
    path = training.save_state("resume-check").result().path
    assert path == f"tinker://{training.get_info().model_id}/weights/resume-check"
    settings = dataclasses.replace(server.settings, api_key="", port=0)
    second = TinkerServer(settings).start()
    try:
        other = tinker.ServiceClient(base_url=second.base_url, api_key=second.api_key)
        resumed = other.create_training_client_from_state_with_optimizer(path).result()
        weights_only = other.create_training_client_from_state(path).result()  # a second client: new moments
        outputs = []
        for client in (training, resumed, weights_only):
            for _ in range(2):
                client.forward_backward([datum(d) for d in data], "importance_sampling").result()
                client.optim_step(types.AdamParams(**ADAM)).result()
            outputs.append(client.forward([datum(d) for d in data], "cross_entropy").result())
        logprobs = [[o["logprobs"].to_numpy() for o in out.loss_fn_outputs] for out in outputs]
        assert all(np.array_equal(a, b) for a, b in zip(logprobs[0], logprobs[1]))
        assert not any(np.allclose(a, c, atol=1e-4) for a, c in zip(logprobs[0], logprobs[2]))
        other.close("success")
    finally:
        second.stop()
    for _ in range(3):  # keep the reference in step with the first server
        reference.forward_backward(data, "importance_sampling")
        reference.step()


def test_two_clients_of_two_shapes_share_the_base_weights_train_apart_and_sample_their_own_adapters(
        server, clients, tiny_dir):
    service, first, reference = clients
    data = rl_data(reference, np.random.default_rng(9))
    before = first.forward([datum(d) for d in data], "cross_entropy").result()
    # another shape: rank 2 on the attention only, in the engine's adapter of rank 8 on all seven projections
    second = service.create_lora_training_client(base_model=server.service.base_model, rank=2,
                                                 train_mlp=False).result()
    other = Reference(tiny_dir, 2, ATTN, SEED + 1)  # its adapter: a fresh one, drawn from the server's seed + 1
    with torch.no_grad(), other.model.disable_adapter():
        base = [other.logprobs(d["tokens"], d["target_tokens"]) for d in data]
    start = second.forward([datum(d) for d in data], "cross_entropy").result()
    for out, want in zip(start.loss_fn_outputs, base):  # B = 0: a fresh adapter leaves the base model as it is
        np.testing.assert_allclose(out["logprobs"].to_numpy(), want.numpy(), atol=1e-5, rtol=0)
    for _ in range(2):  # interleaved: each call swaps the other client's adapter, moments and gradients out
        second.forward_backward([datum(d) for d in data], "importance_sampling").result()
        first.forward([datum(d) for d in data], "cross_entropy").result()
        second.optim_step(types.AdamParams(**ADAM)).result()
        other.forward_backward(data, "importance_sampling")
        other.step()
    assert_same_forward(second, other, data, atol=2e-5)
    after = first.forward([datum(d) for d in data], "cross_entropy").result()
    for a, b in zip(before.loss_fn_outputs, after.loss_fn_outputs):  # the first client's adapter untouched
        assert np.array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
    prompt = [21, 22, 15, 27]
    scores = []
    for client in (first, second):  # each sampler scores as its own client's trainer does
        sampler = client.save_weights_and_get_sampling_client().result()
        scores.append(np.array(sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:]))
        trained = client.forward([datum({"tokens": prompt[:-1], "target_tokens": prompt[1:]})], "cross_entropy")
        np.testing.assert_allclose(scores[-1], trained.result().loss_fn_outputs[0]["logprobs"].to_numpy(),
                                   atol=1e-4, rtol=0)
    assert np.abs(scores[0] - scores[1]).max() > 1e-2  # and the two adapters differ
    path = second.save_state("own-shape").result().path  # saved in the client's own shape, not the engine's
    model_id = second.get_info().model_id
    saved = torch.load(server.service.run_dir / model_id.replace(":", "_") / "weights" / "own-shape" / "state.pt",
                       weights_only=False)
    first.forward([datum(d) for d in data], "cross_entropy").result()  # swapped out and back in, nothing accumulated:
    second.optim_step(types.AdamParams(**ADAM)).result()  # a step with no gradient steps nothing, padding included
    second.save_state("empty-step").result()
    after_empty = torch.load(server.service.run_dir / model_id.replace(":", "_") / "weights" / "empty-step" / "state.pt",
                             weights_only=False)
    assert after_empty["adam_step"] == saved["adam_step"]
    assert all(torch.equal(after_empty["model"][n], t) for n, t in saved["model"].items())
    assert {name: tuple(t.shape) for name, t in saved["model"].items()} == \
        {name: tuple(p.shape) for name, p in other.named().items()}
    assert saved["exp_avg"].keys() == saved["model"].keys() and saved["adapter_config"]["r"] == 2
    reloaded = service.create_training_client_from_state(path).result()  # padded into the engine again
    for a, b in zip(reloaded.forward([datum(d) for d in data], "cross_entropy").result().loss_fn_outputs,
                    second.forward([datum(d) for d in data], "cross_entropy").result().loss_fn_outputs):
        assert np.array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
    with pytest.raises(tinker.RequestFailedError, match=re.escape(
            f"{path} holds an adapter of rank 2, train_attn=True, train_mlp=False;"
            f" {first.get_info().model_id} trains one of rank 4, train_attn=True, train_mlp=True")):
        first.load_state(path).result()


def test_the_dashboard_gets_every_call_its_loss_and_the_workers_devices(server, clients):
    import json
    import time as clock

    _, training, reference = clients
    data = rl_data(reference, np.random.default_rng(3))
    loss = training.forward([datum(d) for d in data], "importance_sampling").result().metrics["loss:sum"]
    server.service.telemetry.flush()
    path = server.service.dashboard_dir / "telemetry.jsonl"
    deadline = clock.time() + 10  # the workers' device samples arrive once a second
    while True:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if any(r["kind"] == "device" and r["role"] == "rollout,actor" for r in records) or clock.time() > deadline:
            break
        clock.sleep(0.5)
    calls = [r for r in records if r["kind"] == "service"]
    last = [r for r in calls if r["call"] == "forward"][-1]
    assert (last["loss_sum"], last["datums"], last["loss_fn"]) == (loss, 2, "importance_sampling")
    assert {"create_session", "create_model", "forward_backward", "optim_step", "sample", "save",
            "create_sampler"} <= {r["call"] for r in calls}
    run = next(r for r in records if r["kind"] == "run")
    assert run["name"] == f"tinker {server.service.base_model}" and server.service.base_model in run["explanation"]
    assert any(r["kind"] == "device" and r["role"] == "rollout,actor" for r in records)  # the System section's


def test_refusals_name_what_is_wrong(server, clients):
    _, training, _ = clients
    d = types.Datum(model_input=types.ModelInput.from_ints([21, 22]), loss_fn_inputs={"target_tokens": [22, 15]})
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'stable_reinforce' is not served here: it is not"
                                                        " public"):
        training.forward_backward([d], "stable_reinforce").result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'ppo' needs loss_fn_inputs logprobs, advantages"):
        training.forward_backward([d], "ppo").result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn_config for 'ppo' takes clip_low_threshold,"
                                                        " clip_high_threshold; got beta"):
        training.forward_backward([d], "ppo", loss_fn_config={"beta": 1.0}).result()
    wrong = tinker.ServiceClient(base_url=server.base_url, api_key="tml-wrong")
    with pytest.raises(tinker.AuthenticationError, match="missing or wrong X-API-Key"):
        wrong.create_lora_training_client(base_model=server.service.base_model, rank=RANK).result()
    other = httpx.get(f"{server.base_url}/api/v1/training_runs", headers={"X-API-Key": server.api_key})
    assert other.status_code == 404
    assert "training_runs is not served by hybridlab's Tinker server" in other.json()["detail"]


def test_the_cookbooks_own_sl_loop_and_rl_loop_run_unchanged_against_the_server(server, clients, tmp_path,
                                                                                 monkeypatch):
    import json

    import datasets
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.exceptions import ConfigurationError

    from hybridlab.tinker import cookbook

    service, training, _ = clients
    tokenizer = training.get_tokenizer()
    chat = [{"role": "user", "content": "6+24="}, {"role": "assistant", "content": "30"}]
    renderer = renderers.get_renderer(cookbook.DEFAULT_RENDERER, tokenizer)  # the zoo's chat template, exactly
    assert renderer.build_generation_prompt(chat[:1]).to_ints() == tokenizer.apply_chat_template(
        chat[:1], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert renderer.get_stop_sequences() == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with cookbook.offline_recipe():  # what the recipes look up while they run: ours for names the cookbook lacks
        assert model_info.get_recommended_renderer_name(server.service.base_model) == "qwen3_instruct"
        assert model_info.get_recommended_renderer_name("Qwen/Qwen3-8B") == "qwen3"
        assert datasets.load_dataset("openai/gsm8k", "main")["train"][0] == {"question": "6+24=", "answer": "#### 30"}
    with pytest.raises(ConfigurationError):
        model_info.get_recommended_renderer_name(server.service.base_model)  # restored after

    monkeypatch.setenv("TINKER_API_KEY", server.api_key)  # where the recipes' ServiceClient reads it
    common = dict(base_url=server.base_url, model_name=server.service.base_model, lora_rank=RANK, save_every=0)
    cookbook.run_recipe("sl_loop", dict(common, batch_size=16, learning_rate=1e-2, max_length=128,
                                        log_path=str(tmp_path / "sl")), rows=48)
    nll = [json.loads(line)["train_mean_nll"] for line in (tmp_path / "sl" / "metrics.jsonl").read_text().splitlines()]
    assert len(nll) == 3 and nll[0] > nll[1] > nll[2] and nll[0] - nll[2] > 0.3  # 48 rows, one epoch of 16s
    final = json.loads((tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")
    sampler = service.create_sampling_client(model_path=final["sampler_path"]).result()  # the adapter it saved
    assert len(sampler.sample(types.ModelInput.from_ints(tokenizer.encode("6+24=")), 1,
                              types.SamplingParams(max_tokens=2, temperature=1.0)).result().sequences) == 1

    def sample_requests() -> int:
        server.service.telemetry.flush()
        lines = (server.service.dashboard_dir / "telemetry.jsonl").read_text().splitlines()
        return sum(r.get("requests", 0) for r in map(json.loads, lines) if r.get("call") == "sample")

    before = sample_requests()
    cookbook.run_recipe("rl_loop", dict(common, batch_size=2, group_size=4, max_tokens=8, max_steps=2,
                                        loss_fn="importance_sampling", log_path=str(tmp_path / "rl")), rows=8)
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["progress/batch"] for r in rows] == [0, 1]
    # the zoo model never writes \boxed{}: every reward 0, so the recipe skips its training calls (its own path for
    # a batch whose advantages are all zero); its datums' training path is what bench tinker's loop runs
    assert [r["reward/total"] for r in rows] == [0.0, 0.0] and not any("grad_norm:mean" in r for r in rows)
    assert sample_requests() - before == 4  # two batches of two questions, each one request of group_size samples
    assert json.loads((tmp_path / "rl" / "checkpoints.jsonl").read_text().splitlines()[-1])["name"] == "final"

    with pytest.raises(UserError, match="recipe 'rl_loop_v2' is not one this runs offline; choose one of"
                                        r" \['sl_loop', 'rl_loop'\]"):
        cookbook.run_recipe("rl_loop_v2", {})


def test_training_calls_run_in_seq_id_order_whatever_order_they_arrive_in(server, clients):
    # last in the module: it takes seq_ids behind the SDK client's back
    _, training, reference = clients
    model_id = training.get_info().model_id
    tokens, targets = [21, 22, 15], [22, 15, 27]
    headers = {"X-API-Key": server.api_key}

    def chunk(seq: int, forward_only: bool) -> dict:
        request = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy",
                                            forward_only=forward_only)
        d = request.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
        t = d.loss_fn_inputs["target_tokens"]
        t.dense, t.dtype = np.asarray(targets, np.int64).tobytes(), pb.DTYPE_INT64
        return httpx.post(f"{server.base_url}/api/v1/forward_backward", content=request.SerializeToString(),
                          headers={**headers, "Content-Type": "application/x-protobuf"}, timeout=60).json()

    def result(request_id: str) -> bytes:
        return httpx.post(f"{server.base_url}/api/v1/retrieve_future", headers=headers, timeout=60,
                          json={"request_id": request_id}).content

    level(server, training, reference)
    first = server.sequencers[model_id].next_seq  # the SDK client's calls took the ids before
    late = chunk(first + 2, forward_only=True)  # sent first, runs last: it must see the step
    big = {**ADAM, "learning_rate": 0.05}
    step = httpx.post(f"{server.base_url}/api/v1/optim_step", headers=headers, timeout=60, json={
        "model_id": model_id, "seq_id": first + 1, "type": "optim_step", "adam_params": big}).json()
    early = chunk(first, forward_only=False)  # sent last, runs first: the step applies its gradient
    assert chunk(first, forward_only=False) == early  # a retried seq_id gets the same request back
    def logprobs(request_id: str) -> np.ndarray:
        output = pb.ForwardBackwardOutput()
        output.ParseFromString(result(request_id))
        return np.frombuffer(output.loss_fn_outputs[0].fields["logprobs"].data, np.float32)

    before = logprobs(early["request_id"])
    result(step["request_id"])
    reference.forward_backward([{"tokens": tokens, "target_tokens": targets}], "cross_entropy")
    for group in reference.opt.param_groups:
        group["lr"] = big["learning_rate"]
    reference.step()
    after = logprobs(late["request_id"])
    with torch.no_grad():
        np.testing.assert_allclose(after, reference.logprobs(tokens, targets).numpy(), atol=2e-5, rtol=0)
    assert np.abs(after - before).max() > 0.1  # the forward ran after the step, not when it arrived


def test_bad_settings_are_refused_by_name_before_any_worker_starts(capfd, tmp_path):
    from hybridlab.cli import main

    listed = tmp_path / "listed.yaml"
    listed.write_text("- port\n- 8000\n")
    assert main(["serve", "tinker", str(listed), "port=8000"]) == 2  # not a mapping, with overrides on top
    assert capfd.readouterr().err == f"error: {listed}: expected a mapping of settings, got list\n"

    assert main(["serve", "tinker", "port=70000", "api_key=abc", "colour=blue"]) == 2
    assert "error: unknown key colour; allowed keys: model, name, host, port, api_key" in capfd.readouterr().err
    assert main(["serve", "tinker", "port=eighty"]) == 2
    assert capfd.readouterr().err == "error: port: expected int, got 'eighty' (str)\n"
    assert main(["serve", "tinker", "port=70000", "api_key=abc"]) == 2
    assert capfd.readouterr().err == ("error: tinker service settings:\n"
                                      "  api_key must start with 'tml-' (the Tinker SDK refuses other keys)\n"
                                      "  port must be in 0..65535, got 70000\n")


def test_serve_tinker_explain_says_what_runs_where(tiny_dir, tmp_path, capfd):
    from hybridlab.cli import main

    assert main(["serve", "tinker", f"model={tiny_dir}", f"run_dir={tmp_path}", f"hub_cache={tmp_path / 'hub'}",
                 "max_lora_rank=16", "--explain"]) == 0
    out = capfd.readouterr().out
    assert out.startswith(f"**hybridlab/{tiny_dir.name}** ({tiny_dir}), context 512 tokens. One device")
    assert "a LoRA adapter of rank up to 16, alpha 32, on the FSDP2 backend" in out
    assert not (tmp_path / "hub").exists()  # explaining writes nothing: the tokenizer is published at start
    assert main(["explain", "--service", "tinker", f"model={tiny_dir}", f"run_dir={tmp_path}",
                 f"hub_cache={tmp_path / 'hub'}", "max_lora_rank=16"]) == 0  # `hybridlab explain` says the same
    assert capfd.readouterr().out == out
    assert main(["explain", "--service", "tinker", "max_lora_rank=0"]) == 2
    assert "max_lora_rank" in capfd.readouterr().err
