"""Write the ``top_level.txt`` that many wheels leave out, so that ``packages_distributions()`` is
quick in every process of this environment.

``importlib.metadata.packages_distributions()`` maps import names to distributions. For a
distribution without ``top_level.txt`` (about half of ours: wheels built by hatchling, flit,
maturin and others do not write it) Python before 3.12 infers the names from the distribution's
whole file list, building a path object for each of the ~47,000 files of this environment.
transformers calls it when imported (``transformers/utils/import_utils.py``), and so every
process that imports transformers (each vLLM and training worker, each driver and notebook
kernel) paid 0.85 s of CPU for it on the AMD EPYC without AVX-512 before this script ran.

For each distribution in this environment's site-packages that has no ``top_level.txt``, this
writes the names that this Python infers (its own ``importlib.metadata._top_level_inferred``,
whose rule differs between versions: 3.11 counts ``.py`` files, 3.12 every file), and lists
the new file in the distribution's ``RECORD`` first, so that ``pip uninstall`` removes it. The
mapping is unchanged (``tests/test_install.py`` compares each file with Python's inference);
only the time to compute it is not. A Python without that function gets no files. Safe to
re-run; ``scripts/install.sh`` runs it after every install. Run as
``python scripts/top_level.py``; prints how many files it wrote.
"""
from __future__ import annotations

import importlib.metadata as md
import site
from pathlib import Path


def inferred_top_level(dist: md.Distribution) -> set[str]:
    """Return the import names this Python infers for ``dist`` from its file list when it has no
    ``top_level.txt`` (empty where this Python has no such inference)."""
    infer = getattr(md, "_top_level_inferred", None)
    return set(infer(dist)) if infer is not None else set()


def installed() -> list[md.Distribution]:
    """Return the distributions installed in this environment's site-packages (not those that
    a package vendors in folders of its own, such as setuptools' ``_vendor``)."""
    return list(md.distributions(path=site.getsitepackages()))


def write_missing(dists: list[md.Distribution]) -> int:
    """Write ``top_level.txt`` for each of ``dists`` that has none and whose files name at least
    one module; returns how many were written."""
    written = 0
    for dist in dists:
        folder = getattr(dist, "_path", None)
        if not isinstance(folder, Path) or not folder.name.endswith(".dist-info"):
            continue  # an egg or another layout: left to Python's inference
        if dist.read_text("top_level.txt") is not None:
            continue
        names = inferred_top_level(dist)
        if not names:  # an empty file would be read as no declaration and inferred again
            continue
        record = folder / "RECORD"
        if record.is_file():  # first: a file pip knows of is never left behind by an uninstall
            text = record.read_text(encoding="utf-8")
            with record.open("a", encoding="utf-8") as out:
                out.write(("" if text.endswith("\n") or not text else "\n") + f"{folder.name}/top_level.txt,,\n")
        (folder / "top_level.txt").write_text("".join(f"{name}\n" for name in sorted(names)), encoding="utf-8")
        written += 1
    return written


if __name__ == "__main__":
    count = write_missing(installed())
    print(f"top_level.txt written for {count} distributions")
