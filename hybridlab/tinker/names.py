"""Model names the Tinker SDK and the cookbook can load a tokenizer for, with no hub access.

The SDK's sampling client loads ``AutoTokenizer.from_pretrained(base_model)`` (a name with two
slashes cut to ``org/model``), and the cookbook's ``get_tokenizer(model_name)`` does the same;
neither takes a folder of ours. So a served model gets an ``org/model`` name
(``hybridlab/tiny``), and its tokenizer files are placed in the Hugging Face hub cache under
that name, laid out as a download would leave them: with ``HF_HUB_OFFLINE=1`` transformers then
finds them there.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from hybridlab.atomic import atomic_dir

WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def hub_cache(cache_dir: str = "") -> Path:
    """Return the hub cache folder: ``cache_dir``, else huggingface_hub's (``HF_HUB_CACHE``)."""
    if cache_dir:
        return Path(cache_dir)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def publish_tokenizer(model_dir: Path, repo_id: str, cache_dir: str = "") -> Path:
    """Place ``model_dir``'s files other than weights (tokenizer, config, chat template) in the
    hub cache as repo ``repo_id``; returns the snapshot folder. Idempotent: the revision is a hash
    of the files, and a snapshot that exists is left as it is."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file() and not p.name.endswith(WEIGHTS))
    digest = hashlib.sha1()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    revision = digest.hexdigest()
    repo = hub_cache(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    if not snapshot.is_dir():
        with atomic_dir(snapshot) as tmp:
            for path in files:
                shutil.copy2(path, tmp / path.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot
