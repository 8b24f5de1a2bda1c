"""Import what a config names by ``package.module:name`` or ``path/to/file.py:name``."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from hybridlab.errors import UserError


def load_object(spec: str, setting: str, kind: str = "function") -> Any:
    """Return the object ``spec`` names; raises UserError naming ``setting`` (the config key)
    when the spec is malformed, the module or file is missing, or it has no such ``kind`` of
    thing (the word the error uses: "function", "class")."""
    if ":" not in spec:
        raise UserError(f"{setting} {spec!r} must look like package.module:{kind} or path/file.py:{kind}")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UserError(f"{setting}: no file {where!r}")
        module_name = f"hybridlab_user_{setting.replace('.', '_')}_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise UserError(f"{setting}: cannot import {where!r}: {exc}") from None
    if not hasattr(module, name):
        raise UserError(f"{setting}: {where!r} has no {kind} {name!r}")
    return getattr(module, name)
