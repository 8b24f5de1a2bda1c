"""The mapping advisor against published GPU runs (``hybridlab bench published``): the models'
sizes as their publishers state them, each prediction's derived figures as the ratios of the
reported ones, and the arithmetic that shows a seed's step time cannot hold."""
from __future__ import annotations

import statistics

import pytest

from bench_json import run_bench
from hybridlab.advisor.cost_model import Workload
from hybridlab.bench.published import model_dims


@pytest.mark.parametrize("model, total, active", [("Qwen3-30B-A3B", 30.5e9, 3.3e9), ("Qwen3-32B", 32.8e9, 32.8e9),
                                                  ("Qwen2.5-Math-7B", 7.6e9, 7.6e9), ("Llama-2-70B", 69.0e9, 69.0e9)])
def test_the_published_models_parameters_counted_from_their_configs_are_what_their_cards_state(model, total, active):
    work = Workload(samples=1, prompt_mean=1, prompt_max=1, response_mean=1, response_max=1, **model_dims(model))
    assert work.params == pytest.approx(total, rel=0.01)          # model cards: 30.5B, 32.8B, 7.6B; Llama 2: 69.0B
    assert work.active_params == pytest.approx(active, rel=0.02)  # Qwen3-30B-A3B: 3.3B activated


def test_bench_published_compares_every_row_with_its_own_arithmetic(capfd):
    result = run_bench(["published"], capfd)
    assert result["measured"] is False
    # G-Average Seq len of each row, as NeMo-RL's tables publish it
    sequences = {"NeMo-RL v0.6 Qwen3-30B-A3B on-policy": 3203, "NeMo-RL v0.6 Qwen3-30B-A3B one step off-policy": 3201,
                 "NeMo-RL v0.5 Qwen3-32B on-policy": 3251, "NeMo-RL v0.5 Qwen3-32B one step off-policy": 3252}
    assert [r["run"].split(",")[0] for r in result["rows"]] == list(sequences)
    for row, sequence in zip(result["rows"], sequences.values()):
        gpus = sum(p["devices"] for p in row["mapping"]["pools"].values())
        # tokens/s/GPU as NeMo-RL counts them: every sample's prompt and response over the step and all GPUs
        assert row["predicted"]["tokens_per_s_per_gpu"] == pytest.approx(
            2048 * sequence / (row["predicted"]["step_s"] * gpus), rel=1e-3)
        for key in ("step_s", "tokens_per_s_per_gpu"):
            assert row["error"][key] == pytest.approx(row["predicted"][key] / row["published"][key] - 1, abs=2e-3)
        # on-policy the stages add up; one step off-policy (generation on its own GPUs) the step is the longer side
        stages, off = row["predicted"]["stage_s"], "off-policy" in row["run"]
        assert row["predicted"]["overlapped"] is off
        expected = max(stages["generate"], sum(stages.values()) - stages["generate"]) if off else sum(stages.values())
        assert row["predicted"]["step_s"] == pytest.approx(expected, abs=0.1)
    assert result["median_abs_error"] == pytest.approx(
        statistics.median(abs(r["error"]["step_s"]) for r in result["rows"]), abs=1e-3)
    # the figures docs/advisor.md quotes (a change to the cost model that moves them moves the docs too)
    assert [r["predicted"]["step_s"] for r in result["rows"]] == [96.8, 71.3, 249.7, 165.3]
    assert result["median_abs_error"] == 0.416
    speedup = result["async_speedup"]
    assert speedup["published_speedup"] == round(356.30 / 150.63, 3) and speedup["profile"] == "h20"
    for mean, p in speedup["predicted"].items():
        assert p["speedup"] == pytest.approx(p["colocated_s"] / p["streaming_s"], abs=2e-3)
        stages = p["streaming_stages_s"]  # streaming: the longer side, then the sync that pauses both
        rest = sum(stages.values()) - stages["generate"] - stages["sync_weights"]
        assert p["streaming_s"] == pytest.approx(max(stages["generate"], rest) + stages["sync_weights"], abs=0.2)
        assert stages["rollout_as_old_logprob"] == 0.0 and "old_logprob" in p["colocated_stages_s"]  # verl's basis
        assert speedup["error"][mean] == round(p["speedup"] / speedup["published_speedup"] - 1, 3)
    # streaming decodes the mean response at a full batch: cheaper than the colocated drain to the 28K tail
    at_2k = speedup["predicted"]["2048"]  # docs/advisor.md quotes these
    assert at_2k["streaming_stages_s"]["generate"] < at_2k["colocated_stages_s"]["generate"] / 2
    # the bound: 16 GPUs x 148 TFLOP/s x 269.80 s / (6 x 7.62B params x 8,192 sequences), less the 512-token prompt
    bound = int(16 * 148e12 * 269.80 / (6 * 7_615_616_512 * 8192)) - 512
    assert speedup["response_bound"] == bound == 1194
    assert [m for m, p in speedup["predicted"].items() if p["feasible"]] == ["512", "1024", "1194"]
    assert [p["speedup"] for p in speedup["predicted"].values()] == [3.048, 2.27, 2.115, 1.645, 1.226, 0.98]
    assert speedup["error_at_bound"] == speedup["error"]["1194"] == -0.106
    assert [at_2k["streaming_stages_s"][k] for k in ("generate", "update_actor")] == [51.5, 260.1]
    seeds = result["seeds"]
    # the update alone, every FLOP at the A100's bf16 peak: 6 x 69.0B x 2^20 tokens / (64 x 312 TFLOP/s)
    assert seeds["update_lower_bound_s"] == pytest.approx(6 * 68_976_648_192 * 2**20 / (64 * 312e12), abs=0.05)
    assert seeds["update_lower_bound_s"] > 20 * seeds["published"]["colocated"]["step_s"]
    assert seeds["predicted"]["colocated"]["step_s"] > seeds["update_lower_bound_s"]
    assert [seeds["predicted"][k]["step_s"] for k in ("colocated", "separate_pools")] == [204.2, 354.1]
