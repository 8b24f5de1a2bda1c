"""Save a randomly initialised model with Qwen3-0.6B's dimensions, for the scale check.

    .venv/bin/python scripts/qwen3_shape.py OUT_DIR [--layers N]

28 layers, hidden 1,024, 16 query and 8 key/value heads, head_dim 128, MLP 3,072, Qwen3's
vocabulary of 151,936, tied embeddings, QK-norm: about 0.6B parameters, 2.4 GB in fp32. The
weights are random (nothing is downloaded); the zoo's tokenizer is saved with it, so its
token ids cover only the first 320 rows of the vocabulary. Then, for example:

    hybridlab explain model=OUT_DIR ...           # the predicted memory per worker
    hybridlab bench train --models OUT_DIR --json # tokens/s against transformers
"""
from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    """Build the checkpoint directory given on the command line; prints its path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    from hybridlab.atomic import atomic_model_dir
    from hybridlab.models.zoo import END_OF_TURN, train_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with atomic_model_dir(args.out) as tmp:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, END_OF_TURN], pad_token_id=0)
        model.save_pretrained(tmp)
        train_tokenizer().save_pretrained(tmp)
    print(args.out)


if __name__ == "__main__":
    main()
