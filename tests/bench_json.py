"""What the benchmark tests share: run `hybridlab bench NAME --json` in this process and read its
JSON, and check a ratio key against the figures it is computed from."""
import json

from hybridlab.cli import main


def run_bench(argv: list[str], capfd) -> dict:
    """Run ``hybridlab bench ARGV --json`` here; returns its JSON object."""
    assert main(["bench", *argv, "--json"]) == 0
    # Ray forwards worker output to this process asynchronously: take the JSON line.
    return json.loads([line for line in capfd.readouterr().out.splitlines() if line.startswith("{")][-1])


def assert_ratio(value: float, numerator: float, denominator: float, digits: int) -> None:
    """A ratio key equals the ratio of the two reported figures, rounded as the benchmark rounds it."""
    assert value == round(numerator / denominator, digits), (value, numerator, denominator)
