"""The README's Python examples run as written, each in its own process; the RL example at test
size (the trained tiny fixture without a warm start, small batches, 2 steps of `train`)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("ray_address")  # the examples attach to the run's shared Ray cluster

README = Path(__file__).resolve().parents[1] / "README.md"
SESSION = 'RLSession("ppo", ["trainer.devices=2"])'


def at_test_size(block: str, model: Path, run_dir: Path) -> str:
    """The block with its RL session shrunk to test size: the same calls, smaller settings."""
    settings = [f"model={model}", "warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4",
                "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                "data.test_samples=16", "trainer.progress=false", f"trainer.run_dir={run_dir}"]
    for old, new in ((SESSION, f'RLSession("ppo", ["trainer.devices=2", *{settings!r}])'),
                     ("rl.train(50)", "rl.train(2)")):
        assert block.count(old) == 1, f"the README's RL example no longer has {old!r}: update this test"
        block = block.replace(old, new)
    return block


def test_readme_python_blocks_run(trained_dir, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 2 and SESSION in blocks[1], "the README's Python examples changed: update this test"
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(at_test_size(block, trained_dir, tmp_path / "run") if SESSION in block else block)
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"README Python block {i} failed:\n{done.stderr[-3000:]}"
