"""Read and write prompt datasets in verl's column convention (parquet or JSONL).

Columns: ``prompt`` (a string or a list of chat messages ``{"role", "content"}``),
``data_source`` (names the scorer), ``reward_model`` (a dict with ``ground_truth``) and an
optional ``extra_info`` dict. Existing verl datasets load unchanged.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from hybridlab.errors import UserError
from hybridlab.tasks.base import Sample

FORMATS = (".parquet", ".jsonl")
T = TypeVar("T")


def read_rows(path: Path) -> list[tuple[int, dict]]:
    """Return (row number, row) for the rows of a parquet or JSONL file: numbered from 1, a JSONL
    row by its line (blank lines are skipped but counted, so every error names the same line an
    editor shows); errors name the file and the row."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            return list(enumerate(pq.read_table(path).to_pylist(), 1))
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise UserError(f"{path}: not a readable parquet file ({exc})") from None
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}: row {lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}: row {lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append((lineno, row))
    return rows


def _prompt_text(value: Any, where: str) -> tuple[str, list | None]:
    if isinstance(value, str):
        return value, None
    if isinstance(value, (list, tuple)) and value:
        parts = []
        for i, msg in enumerate(value):
            if not isinstance(msg, dict) or not isinstance(msg.get("content"), str):
                raise UserError(f"{where}: field 'prompt'[{i}] must be a message with a string 'content'")
            parts.append(msg["content"])
        return "\n".join(parts), [dict(m) for m in value]
    raise UserError(f"{where}: field 'prompt' must be a non-empty string or list of chat messages,"
                    f" got {type(value).__name__}")


def load_dataset(path: str | os.PathLike, limit: int | None = None) -> list[Sample]:
    """Return the samples of a verl-style parquet or JSONL file (at most ``limit``).

    Errors name the file, the row (1-based) and the field that is missing or malformed.
    """
    return parse_rows(path, limit, sample_from_row)


def parse_rows(path: str | os.PathLike, limit: int | None, parse: Callable[[dict, str], T]) -> list[T]:
    """Return ``parse(row, "FILE: row N")`` for the rows of a parquet or JSONL file, at most
    ``limit``; raises UserError naming the file for a bad format, a missing file or no rows."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise UserError(f"{path}: unsupported dataset format {path.suffix!r}; use one of: {', '.join(FORMATS)}")
    if not path.is_file():
        raise UserError(f"{path}: no such dataset file")
    out = []
    for number, row in read_rows(path):
        out.append(parse(row, f"{path}: row {number}"))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise UserError(f"{path}: the dataset has no rows")
    return out


def sample_from_row(row: dict, where: str) -> Sample:
    """Return the Sample of one verl-column row; raises UserError naming ``where`` and the field."""
    for field in ("prompt", "data_source", "reward_model"):
        if row.get(field) is None:
            raise UserError(f"{where}: missing field {field!r}")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise UserError(f"{where}: missing field 'reward_model.ground_truth'")
    if not isinstance(row["data_source"], str):
        raise UserError(f"{where}: field 'data_source' must be a string")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise UserError(f"{where}: field 'extra_info' must be a dict, got {type(extra).__name__}")
    text, messages = _prompt_text(row["prompt"], where)
    if messages is not None:
        extra = {**extra, "messages": messages}
    return Sample(prompt=text, ground_truth=reward_model["ground_truth"], data_source=row["data_source"],
                  answer=str(extra.get("answer", "")), extra_info=extra, origin=where)


def save_dataset(samples: Iterable[Sample], path: str | os.PathLike) -> Path:
    """Write samples as a verl-style parquet or JSONL file (atomically); returns the path."""
    return write_rows([{"prompt": s.prompt, "data_source": s.data_source,
                        "reward_model": {"style": "rule", "ground_truth": s.ground_truth},
                        "extra_info": {"answer": s.answer, **{k: str(v) for k, v in s.extra_info.items()}}}
                       for s in samples], path)


def write_rows(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write dict rows as parquet or JSONL, by the file's suffix, atomically (a reader never sees a
    half-written file); returns the path."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise UserError(f"{path}: unsupported dataset format {path.suffix!r}; use one of: {', '.join(FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), tmp)
    else:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path
