"""Write files so that readers see the old one or the new one, never half of it (model directories, JSON)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock

from hybridlab.errors import UserError


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (aside, then renamed): never half-written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` as JSON atomically (``write_text``)."""
    import json

    write_text(path, json.dumps(data, indent=2))


def replace_dir(new: Path, target: Path) -> None:
    """Move directory ``new`` to ``target``, replacing an old ``target`` without a half-written moment."""
    if not target.exists():
        try:
            os.rename(new, target)
            return
        except OSError:
            if not target.exists():
                raise
    old = target.with_name(f".{target.name}.old.{os.getpid()}")
    os.rename(target, old)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


def check_model_dir_target(out: str | os.PathLike) -> Path:
    """Return ``out`` as a Path if it is free or an earlier model directory, else raise UserError."""
    out = Path(out)
    if out.exists() and not (out / "config.json").is_file():
        raise UserError(f"{out} exists and is not a model directory; choose a new path")
    return out


def built_once(out: Path, build: Callable[[], object]) -> Path:
    """Return the cached model directory ``out``, calling ``build()`` to write it (atomically)
    when it has no config.json yet; processes that ask at once wait on a file lock beside it, so
    it is built once."""
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(out.parent / f".{out.name}.lock"):
            if not (out / "config.json").is_file():
                build()
    return out


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a scratch folder beside ``out``; on success it replaces ``out`` (if any) whole. On
    an error the scratch folder is removed and ``out`` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_model_dir(out: str | os.PathLike) -> Iterator[Path]:
    """``atomic_dir`` for a model directory: ``out`` must be free or an earlier model directory
    (one with a config.json)."""
    with atomic_dir(check_model_dir_target(out)) as tmp:
        yield tmp
