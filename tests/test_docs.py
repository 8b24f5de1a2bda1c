"""The README's Python examples run as written."""
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(block)
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"README Python block {i} failed:\n{done.stderr[-3000:]}"
