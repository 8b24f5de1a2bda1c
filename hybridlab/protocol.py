"""Batch: the one data type that passes between dataflow stages and workers.

A Batch holds per-sample tensors keyed by name (all sharing the first dimension), per-sample
Python objects (lists of the same length) and free-form ``meta``. It splits into
data-parallel chunks (padding uneven sizes and removing the padding again on concat), merges,
selects and repeats, and pickles its tensors as numpy buffers so Ray's object store moves
them without extra copies.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np
import torch

PAD_KEY = "_pad"  # meta key: how many trailing rows of a batch are padding


@dataclasses.dataclass
class Batch:
    """Tensors + per-sample objects + meta, all rows aligned."""

    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    objects: dict[str, list] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.objects = {k: list(v) for k, v in self.objects.items()}
        sizes = {f"tensors[{k!r}]": v.shape[0] if v.dim() else None for k, v in self.tensors.items()}
        sizes.update({f"objects[{k!r}]": len(v) for k, v in self.objects.items()})
        if None in sizes.values():
            raise ValueError(f"Batch tensors need a sample dimension; scalar at {list(sizes)}")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the number of samples: {sizes}")

    # ----------------------------------------------------------------- basics
    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.objects.values():
            return len(v)
        return 0

    def keys(self) -> list[str]:
        """Return the names of all tensor and object fields."""
        return [*self.tensors, *self.objects]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.objects

    def __getitem__(self, key):
        """``batch["name"]`` returns a field; an int, slice, index list or tensor selects rows."""
        if isinstance(key, str):
            if key in self.tensors:
                return self.tensors[key]
            if key in self.objects:
                return self.objects[key]
            raise KeyError(f"Batch has no field {key!r}; fields: {', '.join(self.keys()) or '(none)'}")
        return self.take(key)

    def take(self, index) -> "Batch":
        """Return the rows selected by an int, slice, index sequence or bool/long tensor."""
        if isinstance(index, int):
            index = [index]
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            index = index.nonzero().flatten()
        if isinstance(index, slice):
            rows = range(len(self))[index]
            tensors = {k: v[index] for k, v in self.tensors.items()}
        else:
            rows = [int(i) for i in index]
            idx = torch.as_tensor(rows, dtype=torch.long)
            tensors = {k: v.index_select(0, idx) for k, v in self.tensors.items()}
        objects = {k: [v[i] for i in rows] for k, v in self.objects.items()}
        return Batch(tensors, objects, {k: v for k, v in self.meta.items() if k != PAD_KEY})

    def select(self, keys: Iterable[str], meta: bool = True) -> "Batch":
        """Return a Batch with only the named fields (sharing their storage)."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no field(s) {missing}; fields: {', '.join(self.keys())}")
        return Batch({k: v for k, v in self.tensors.items() if k in keys},
                     {k: v for k, v in self.objects.items() if k in keys}, dict(self.meta) if meta else {})

    def union(self, other: "Batch") -> "Batch":
        """Return the fields of both batches; a field present in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot merge batches of {len(self)} and {len(other)} samples")
        tensors = dict(self.tensors)
        for k, v in other.tensors.items():
            if k in tensors and not (tensors[k] is v or torch.equal(tensors[k], v)):
                raise ValueError(f"cannot merge: tensor {k!r} differs between the batches")
            tensors[k] = v
        objects = dict(self.objects)
        for k, v in other.objects.items():
            if k in objects and objects[k] != v:
                raise ValueError(f"cannot merge: object field {k!r} differs between the batches")
            objects[k] = v
        return Batch(tensors, objects, {**self.meta, **other.meta})

    @property
    def nbytes(self) -> int:
        """Return the bytes held by the tensors (objects are not counted)."""
        return sum(v.numel() * v.element_size() for v in self.tensors.values())

    # ------------------------------------------------------ data parallelism
    def chunk(self, n: int) -> list["Batch"]:
        """Split into ``n`` equal chunks, padding with copies of the first rows if needed.

        Each chunk's ``meta["_pad"]`` says how many of its trailing rows are padding;
        ``Batch.concat`` drops them again.
        """
        if n < 1:
            raise ValueError(f"cannot split a batch into {n} chunks")
        size = len(self)
        per = -(-size // n) if size else 0
        pad = per * n - size
        padded = self if pad == 0 else Batch.concat([self, self.take(list(range(pad)) if size >= pad
                                                                 else [i % size for i in range(pad)])])
        out = []
        for i in range(n):
            part = padded.take(slice(i * per, (i + 1) * per))
            part.meta = dict(self.meta)
            pad_here = max(0, (i + 1) * per - size) - max(0, i * per - size)
            if pad_here:
                part.meta[PAD_KEY] = pad_here
            out.append(part)
        return out

    @classmethod
    def concat(cls, batches: Sequence["Batch"]) -> "Batch":
        """Concatenate batches row-wise, dropping padding rows recorded by ``chunk``."""
        batches = [b for b in batches if b is not None]
        if not batches:
            return cls()
        trimmed = [b.take(slice(0, len(b) - b.meta[PAD_KEY])) if b.meta.get(PAD_KEY) else b for b in batches]
        first = trimmed[0]
        for b in trimmed[1:]:
            if set(b.tensors) != set(first.tensors) or set(b.objects) != set(first.objects):
                raise ValueError(f"cannot concatenate batches with different fields: {sorted(first.keys())}"
                                 f" vs {sorted(b.keys())}")
        tensors = {k: torch.cat([b.tensors[k] for b in trimmed]) for k in first.tensors}
        objects = {k: [x for b in trimmed for x in b.objects[k]] for k in first.objects}
        meta = {k: v for k, v in batches[0].meta.items() if k != PAD_KEY}
        return cls(tensors, objects, meta)

    def repeat(self, n: int, interleave: bool = True) -> "Batch":
        """Return each sample ``n`` times: a a b b (interleave) or a b a b."""
        size = len(self)
        idx = [i for i in range(size) for _ in range(n)] if interleave else [i for _ in range(n) for i in range(size)]
        return self.take(idx)

    # ------------------------------------------------------------- transport
    def __reduce__(self):
        # numpy arrays travel through Ray's object store as out-of-band buffers (zero-copy on
        # read); torch tensors would be copied by torch's own pickling.
        packed = {k: _to_numpy(v) for k, v in self.tensors.items()}
        return _unpack, (packed, self.objects, self.meta)

    def __repr__(self) -> str:
        fields = [f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in self.tensors.items()]
        fields += [f"{k}: list" for k in self.objects]
        return f"Batch({len(self)} samples; {', '.join(fields)}; meta keys {sorted(self.meta)})"


SMALL_BYTES = 16 * 1024  # below this, plain bytes pickle faster than out-of-band buffers


def _to_numpy(t: torch.Tensor) -> tuple[np.ndarray | bytes, str, tuple]:
    t = t.detach().cpu().contiguous()
    tag = ""
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bits
        t, tag = t.view(torch.int16), "bfloat16"
    arr = t.numpy()
    if arr.nbytes < SMALL_BYTES:
        return arr.tobytes(), f"{tag}|{arr.dtype.str}", arr.shape
    return arr, tag, arr.shape


def _unpack(packed: dict, objects: dict, meta: dict) -> Batch:
    tensors = {}
    for k, (arr, tag, shape) in packed.items():
        if isinstance(arr, bytes):
            tag, dtype = tag.split("|", 1)  # a one-byte dtype's str starts with "|" too ("|i1", "|b1")
            t = torch.from_numpy(np.frombuffer(arr, dtype=dtype).copy().reshape(shape))
        else:
            t = torch.from_numpy(arr) if arr.flags.writeable else _readonly_tensor(arr)
        tensors[k] = t.view(torch.bfloat16) if tag == "bfloat16" else t
    return Batch(tensors, objects, meta)


def _readonly_tensor(arr: np.ndarray) -> torch.Tensor:
    import warnings

    # Arrays read from Ray's object store are read-only views of shared memory. Sharing them
    # is the point (no copy); writing to such a tensor in place is a bug in the caller anyway.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)
