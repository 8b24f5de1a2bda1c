"""MetricsLog: per-step metrics appended to ``metrics.jsonl`` and TensorBoard event files."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path


class MetricsLog:
    """Appends one JSON line per step (flushed at once) and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, purge_after: int | None = None):
        """``purge_after``: a resumed run's checkpoint step; TensorBoard hides the events of later
        steps written before the run stopped (they are logged again)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if purge_after is None else purge_after + 1
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=purge)

    def write(self, step: int, metrics: dict) -> None:
        """Record ``metrics`` for ``step`` (non-finite numbers are written as null)."""
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._tb is not None:  # one event holds the step's scalars: an add_scalar each took 10 ms a step
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in clean.items()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if values:
                self._tb.file_writer.add_summary(Summary(value=values), step)
                self._tb.flush()

    def tell(self) -> int:
        """Return the bytes written to ``metrics.jsonl`` so far (all of them flushed)."""
        self._file.flush()
        return self._file.tell()

    def close(self) -> None:
        """Close the files."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
