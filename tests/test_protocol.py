"""Batch: splitting, padding, merging, repeating and pickling keep every row where it belongs."""
import pickle

import pytest
import torch

from hybridlab.protocol import Batch


def make(n=5):
    return Batch({"x": torch.arange(n * 2).view(n, 2), "h": torch.arange(n, dtype=torch.bfloat16)},
                 {"text": [f"s{i}" for i in range(n)]}, {"step": 3})


def test_mismatched_lengths_name_the_fields():
    with pytest.raises(ValueError, match=r"tensors\['x'\].*objects\['t'\]"):
        Batch({"x": torch.zeros(3)}, {"t": [1, 2]})


@pytest.mark.parametrize("n,chunks", [(5, 2), (5, 4), (8, 4), (2, 4), (1, 3)])
def test_chunk_pads_and_concat_restores(n, chunks):
    b = make(n)
    parts = b.chunk(chunks)
    assert len(parts) == chunks and len({len(p) for p in parts}) == 1
    assert sum(p.meta.get("_pad", 0) for p in parts) == len(parts[0]) * chunks - n
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["text"] == b["text"] and back.meta == {"step": 3}


def test_take_select_union_repeat():
    b = make(4)
    assert b[1:3]["text"] == ["s1", "s2"]
    assert b.take(torch.tensor([True, False, False, True]))["text"] == ["s0", "s3"]
    assert b[[3, 0]]["x"].tolist() == [[6, 7], [0, 1]]
    assert b.select(["x"]).keys() == ["x"]
    with pytest.raises(KeyError, match="no field"):
        b["nope"]
    merged = b.select(["x"]).union(Batch({"r": torch.ones(4)}))
    assert merged.keys() == ["x", "r"]
    with pytest.raises(ValueError, match="tensor 'x' differs"):
        b.union(Batch({"x": torch.zeros(4, 2, dtype=torch.long)}))
    assert b.repeat(2)["text"] == ["s0", "s0", "s1", "s1", "s2", "s2", "s3", "s3"]
    assert b.repeat(2, interleave=False)["text"][:5] == ["s0", "s1", "s2", "s3", "s0"]


def test_pickle_keeps_dtypes_and_values():
    b = make(3)
    back = pickle.loads(pickle.dumps(b))
    assert back["h"].dtype == torch.bfloat16 and torch.equal(back["h"], b["h"])
    assert torch.equal(back["x"], b["x"]) and back["text"] == b["text"] and back.meta == b.meta
    assert b.nbytes == 3 * 2 * 8 + 3 * 2


def test_pickle_keeps_one_byte_dtypes():
    """numpy writes a one-byte dtype as "|i1" (no byte order): the small-tensor path must read it."""
    b = Batch({"sources": torch.tensor([[1, 2], [0, 5]], dtype=torch.int8), "ok": torch.tensor([True, False]),
               "bytes": torch.tensor([7, 255], dtype=torch.uint8)})
    back = pickle.loads(pickle.dumps(b))
    for key in ("sources", "ok", "bytes"):
        assert back[key].dtype == b[key].dtype and torch.equal(back[key], b[key])


def test_pickle_large_tensors_through_buffers():
    b = Batch({"x": torch.randn(5000, 4), "h": torch.randn(5000, 4).to(torch.bfloat16)})
    back = pickle.loads(pickle.dumps(b, protocol=5))
    assert torch.equal(back["x"], b["x"]) and torch.equal(back["h"], b["h"]) and back["h"].dtype == torch.bfloat16


def test_rollout_parts_pad_prompts_alike_and_rounds_of_different_widths_concatenate():
    from hybridlab.batching import concat_sequences, sequences_batch

    # two data-parallel ranks with prompts of 2 and 4 tokens: the batch's width makes them concatenate
    parts = [sequences_batch([[1, 2]], [[5]], 0, response_len=2, prompt_len=4),
             sequences_batch([[1, 2, 3, 4]], [[6, 7]], 0, response_len=2, prompt_len=4)]
    whole = Batch.concat(parts)
    assert whole["input_ids"].tolist() == [[0, 0, 1, 2, 5, 0], [1, 2, 3, 4, 6, 7]]
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):  # what each rank's own width gave
        Batch.concat([sequences_batch([[1, 2]], [[5]], 0, response_len=2),
                      sequences_batch([[1, 2, 3, 4]], [[6, 7]], 0, response_len=2)])
    # DAPO's refill rounds: generated separately, left-padded to the widest on concatenation
    rounds = concat_sequences([sequences_batch([[1, 2]], [[5]], 0, response_len=2),
                               sequences_batch([[1, 2, 3]], [[6]], 0, response_len=2)])
    assert rounds["input_ids"].tolist() == [[0, 1, 2, 5, 0], [1, 2, 3, 6, 0]]
    assert rounds["attention_mask"].tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert rounds["position_ids"].tolist() == [[0, 0, 1, 2, 2], [0, 1, 2, 3, 3]]
