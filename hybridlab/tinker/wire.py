"""Tinker's wire formats: the protobuf bodies the SDK sends and insists on receiving, and the
JSON pieces (model inputs) of its other calls. The message classes are the SDK's own
(``tinker.proto.tinker_public_pb2``), so a change in the pinned SDK shows here first.

The SDK sends ``forward_backward`` as a ``ForwardBackwardRequest`` and only accepts
``ForwardBackwardOutput`` and ``SampleResponse`` results as protobuf; everything else is JSON.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from hybridlab.errors import UserError

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclasses.dataclass
class FwdBwdCall:
    """One ``forward_backward`` (or ``forward``) chunk as the server runs it."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict
    forward_only: bool
    tokens: list[np.ndarray]            # each datum's model input
    inputs: list[dict[str, np.ndarray]]  # each datum's loss_fn_inputs, one value per position


def _tensor(msg: pb.Tensor, key: str) -> np.ndarray:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise UserError(f"loss_fn_inputs[{key!r}]: dtype {pb.DType.Name(msg.dtype)} is not served (float32, int64)")
    if msg.WhichOneof("encoding") == "sparse_csr":
        values = np.frombuffer(msg.sparse_csr.values, dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, np.int64)
        dense = np.zeros(tuple(msg.shape), dtype)
        for row in range(len(crow) - 1):
            dense[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
        array = dense
    else:
        array = np.frombuffer(msg.dense, dtype)
        if msg.shape:
            array = array.reshape(tuple(msg.shape))
    if array.ndim != 1:
        raise UserError(f"loss_fn_inputs[{key!r}] has shape {list(array.shape)}; this server takes one value per"
                        " position (shape [N])")
    return array


def _chunk_tokens(chunks) -> np.ndarray:
    parts = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"model_input holds a {kind} chunk; this server trains on token chunks only")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _config(request: pb.ForwardBackwardRequest) -> dict:
    config = {k: v for k, v in request.loss_fn_config.items()}
    for key, value in request.loss_fn_config_v2.items():
        config[key] = value.number if value.WhichOneof("value") == "number" else value.text
    return config


def parse_forward_backward(body: bytes) -> FwdBwdCall:
    """Return the chunk a ``ForwardBackwardRequest`` body carries; raises UserError naming a
    datum whose inputs do not line up with its model input."""
    request = pb.ForwardBackwardRequest()
    request.ParseFromString(body)
    tokens, inputs = [], []
    for i, datum in enumerate(request.data):
        ids = _chunk_tokens(datum.model_input)
        row = {key: _tensor(t, key) for key, t in datum.loss_fn_inputs.items()}
        bad = {key: len(v) for key, v in row.items() if len(v) != len(ids)}
        if bad or not len(ids):
            raise UserError(f"datum {i}: model_input has {len(ids)} tokens but loss_fn_inputs lengths are {bad};"
                            " every input has one value per model_input position")
        tokens.append(ids)
        inputs.append(row)
    keys = {frozenset(row) for row in inputs}
    if len(keys) > 1:
        raise UserError(f"the datums of one call carry different loss_fn_inputs: {sorted(map(sorted, keys))}")
    return FwdBwdCall(request.model_id, request.seq_id, request.loss_fn, _config(request), request.forward_only,
                      tokens, inputs)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """Return the ``ForwardBackwardOutput`` body: each datum's per-position ``logprobs`` in one
    record (float32 data with int64 byte offsets) and ``metrics`` (keys ``name:reduction``)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    arrays = [np.asarray(a, np.float32) for a in logprobs]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64).tobytes()
    return out.SerializeToString()


def sample_response(answer: dict) -> bytes:
    """Return the ``SampleResponse`` body of one request's answer (``TinkerSampler.sample_many``):
    each sequence's tokens (int32), log-probs and stop reason, and the prompt's log-probs (NaN
    where there is none) when they were asked for."""
    out = pb.SampleResponse()
    for seq in answer["sequences"]:
        item = out.sequences.add()
        item.stop_reason = pb.STOP_REASON_LENGTH if seq["stop_reason"] == "length" else pb.STOP_REASON_STOP
        item.tokens = np.asarray(seq["tokens"], np.int32).tobytes()
        item.logprobs = np.asarray(seq["logprobs"], np.float32).tobytes()
    if answer.get("prompt_logprobs") is not None:
        values = [np.nan if v is None else v for v in answer["prompt_logprobs"]]
        out.prompt_logprobs = np.asarray(values, np.float32).tobytes()
    return out.SerializeToString()


def model_input_tokens(model_input: dict) -> list[int]:
    """Return the token ids of a JSON ``ModelInput`` ({"chunks": [{"type": "encoded_text",
    "tokens": [...]}, ...]}); raises UserError on any other chunk."""
    tokens: list[int] = []
    for chunk in model_input.get("chunks", []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"the prompt holds a {chunk.get('type')} chunk; this server samples from token chunks only")
        tokens.extend(int(t) for t in chunk["tokens"])
    return tokens
