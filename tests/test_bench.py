"""Benchmarks print the JSON keys their issues promise (numbers are measured, not asserted)."""
import json

from hybridlab.cli import main


def test_bench_dispatch_json(ray_local, capsys):
    assert main(["bench", "dispatch", "--json", "--opt", "iters=20", "--opt", "batch_mb=4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"bare_ray_ms", "dispatch_ms", "overhead_ms", "batch_mb_per_s"} <= set(result)
    assert set(result["dispatch_ms"]) == {"all", "dp", "rank_zero", "raw"}
    assert result["batch_mb_per_s"] > 0 and result["bare_ray_ms"] > 0


def test_unknown_benchmark_lists_names(capsys):
    assert main(["bench", "nope", "--json"]) == 2
    assert "unknown benchmark 'nope'; choose one of: dispatch" in capsys.readouterr().err
