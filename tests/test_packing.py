"""How the training engine cuts a batch into micro-batches (packing.py), without the engine."""
import torch

from hybridlab.batching import sequences_batch
from hybridlab.workers.train import packing


def test_token_budget_plans_fit_the_budget_and_cover_every_row_once():
    lengths = [30, 5, 12, 40, 7, 7, 25, 3]
    groups = packing.plan(lengths, width=40, rows=2, tokens=45, packed=True)
    assert sorted(r for g in groups for r in g) == list(range(8))
    assert all(sum(lengths[r] for r in g) <= 45 for g in groups)
    assert len(groups) == 3  # 129 tokens need at least 3 micro-batches of 45
    # padded, every row costs the full width: one row per 45 tokens ... and a longer row alone
    assert packing.plan(lengths, width=40, rows=2, tokens=45) == [[i] for i in range(8)]
    assert packing.plan([50, 10], width=50, rows=2, tokens=20, packed=True) == [[0], [1]]
    assert packing.plan(lengths, width=40, rows=3) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_pack_lays_real_tokens_end_to_end_and_points_at_each_response_token_predictor():
    batch = sequences_batch([[11, 12, 13], [21]], [[14, 15], [22, 23, 24]], pad_id=0)
    packed = packing.pack(batch.tensors)
    assert packed["input_ids"].tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 24]]
    assert packed["cu_seqlens"].tolist() == [0, 5, 9] and packed["max_seqlen"] == 5
    ids = packed["input_ids"][0]
    real = batch["response_mask"].bool()
    # the logit at response_index predicts the next token: the response token itself follows it
    assert ids[packed["response_index"][real] + 1].tolist() == batch["responses"][real].tolist()
    padded = packing.pack(batch.tensors, pad_to=12)
    assert padded["input_ids"].shape == (1, 12) and padded["cu_seqlens"].tolist() == [0, 5, 9, 12]


def test_micro_batches_put_outputs_back_in_batch_order_and_count_padding():
    batch = sequences_batch([[1, 2], [3], [4, 5, 6], [7]], [[8], [9, 9, 9, 9], [8, 8], [9]], pad_id=0)
    micros = packing.micro_batches(batch.tensors, rows=2, tokens=6, packed=True)
    assert sorted(r for m in micros for r in m.rows) == [0, 1, 2, 3]  # each row once, no repeats
    assert all(m.packed["input_ids"].shape[1] == m.computed_tokens == m.tensors["attention_mask"].sum()
               for m in micros)
    longest = max(m.computed_tokens for m in micros)
    alike = packing.micro_batches(batch.tensors, rows=2, tokens=6, packed=True, one_length=True)
    assert {m.packed["input_ids"].shape[1] for m in alike} == {longest}
    assert packing.padded_share(micros, int(batch["attention_mask"].sum())) == 0.0
    values = [m.tensors["input_ids"].float() for m in micros]
    assert torch.equal(packing.gather_rows(values, micros, 4), batch["input_ids"].float())
    assert [m.rows for m in micros] != [[0, 1], [2, 3]]  # the plan did reorder: the gather put rows back
    micros = packing.micro_batches(batch.tensors, rows=3)
    assert [m.rows for m in micros] == [[0, 1, 2], [3, 4, 5]]  # rows 4 and 5 repeat row 0
    assert micros[1].tensors["response_mask"][1:].sum() == 0  # the repeated rows are out of every loss
    assert packing.padded_share(micros, 15) == 1 - 15 / (6 * 7)
    # padded with a token budget: a row count (14 tokens // width 7 = 2 rows), one shape throughout
    micros = packing.micro_batches(batch.tensors, rows=3, tokens=14)
    assert [m.rows for m in micros] == [[0, 1], [2, 3]]
    micros = packing.micro_batches(batch.tensors, rows=3, tokens=21)
    assert [m.rows for m in micros] == [[0, 1, 2], [3, 4, 5]]


def test_even_micro_batches_spread_the_rows_and_fill_with_padding_only():
    """Expert parallelism: a rank with 5 of at most 8 rows runs 2 micro-batches of 4 rows like its
    peers, each with real rows; the fillers are all padding and their outputs are dropped."""
    from hybridlab.workers.train.packing import even_micro_batches, gather_rows
    from tests.test_train import random_batch

    batch = random_batch(5)
    micros = even_micro_batches(batch.tensors, rows=4, total=8)
    assert [m.rows for m in micros] == [[0, 1, 2, 5], [3, 4, 6, 7]]  # real rows first, fillers numbered after
    for m in micros:
        real = [r < 5 for r in m.rows]
        assert m.tensors["attention_mask"][torch.tensor(real)].sum(1).gt(0).all()
        assert m.tensors["attention_mask"][~torch.tensor(real)].sum() == 0
        assert m.tensors["response_mask"][~torch.tensor(real)].sum() == 0
    lengths = gather_rows([m.tensors["attention_mask"].sum(1) for m in micros], micros, 5)
    assert torch.equal(lengths, batch["attention_mask"].sum(1))
    pairs = even_micro_batches(random_batch(6).tensors, rows=4, total=8, group=2)  # runs of 2 rows kept whole
    assert [m.rows for m in pairs] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # a micro-batch size above the group's rows: one micro-batch of the most rows a rank holds, not 64
    (one,) = even_micro_batches(batch.tensors, rows=64, total=8)
    assert one.rows == [0, 1, 2, 3, 4, 5, 6, 7] and one.computed_tokens == 8 * batch["attention_mask"].shape[1]
    threes = even_micro_batches(random_batch(6).tensors, rows=4, total=10, group=2)  # 5 runs in 3: 2 runs each
    assert [len(m.rows) for m in threes] == [4, 4, 4]
