"""The documentation's Python examples run as written, each in its own process: every ```python
block of README.md and of the pages under docs/. The RL example runs at test size (the trained
tiny fixture without a warm start, small batches, 2 steps of `train`). Shell commands sit in
```bash blocks, which are not run."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("ray_address")  # the examples attach to the run's shared Ray cluster

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SESSION = 'RLSession("ppo", ["trainer.devices=2"])'
MAX_BLOCKS = 5  # each block costs a process start (most about 15 s in CI; the sandbox one 0.2 s): keep the examples few


def python_blocks() -> list[tuple[str, str]]:
    """Return (where, code) for every ```python block of the README and the docs pages."""
    return [(f"{page.relative_to(ROOT)} block {i}", block) for page in PAGES
            for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]


def at_test_size(block: str, model: Path, run_dir: Path) -> str:
    """The block with its RL session shrunk to test size: the same calls, smaller settings."""
    settings = [f"model={model}", "warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4",
                "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                "data.test_samples=16", "trainer.progress=false", f"trainer.run_dir={run_dir}"]
    for old, new in ((SESSION, f'RLSession("ppo", ["trainer.devices=2", *{settings!r}])'),
                     ("rl.train(50)", "rl.train(2)")):
        assert block.count(old) == 1, f"the RL example no longer has {old!r}: update this test"
        block = block.replace(old, new)
    return block


def test_documentation_python_blocks_run(trained_dir, tmp_path):
    blocks = python_blocks()
    assert 2 <= len(blocks) <= MAX_BLOCKS, f"{len(blocks)} Python blocks in the docs: {[w for w, _ in blocks]}"
    rl = [where for where, block in blocks if SESSION in block]
    assert rl == ["README.md block 0"], f"the RL example should be the README's only Python block, found in {rl}"
    for i, (where, block) in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(at_test_size(block, trained_dir, tmp_path / "run") if SESSION in block else block)
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{where} failed:\n{done.stderr[-3000:]}"
