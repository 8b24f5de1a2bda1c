"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, a broken
link fails that build, and the configuration reference names every key of RunConfig. Light:
no Ray, no engines; the builds run in a subprocess with this interpreter."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"


def build(config_dir: Path, site_dir: Path) -> subprocess.CompletedProcess:
    """Run `mkdocs build --strict` on the mkdocs.yml in ``config_dir``."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                          cwd=config_dir, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def nav_pages(nav) -> list[str]:
    """Return the Markdown paths listed in an mkdocs ``nav`` (nested sections included)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_pages(value)]
    return [p for item in nav for p in nav_pages(item)]


def config_keys(cls, prefix: str = "") -> list[str]:
    """Return the dotted names of every leaf field of ``cls`` (``actor.lr``, ``algorithm.kl_ctrl.kl_coef``)."""
    hints = typing.get_type_hints(cls)
    out = []
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            out += config_keys(hints[field.name], f"{prefix}{field.name}.")
        else:
            out.append(prefix + field.name)
    return out


def test_the_site_builds_strictly_with_every_nav_page(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = nav_pages(nav)
    assert sorted(pages) == sorted(p.name for p in (ROOT / "docs").glob("*.md")), "every page in the nav, once"
    for page in pages:
        html = tmp_path / "site" / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert html.is_file(), f"{page}: no {html.relative_to(tmp_path)}"


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "concepts.md", "a") as page:
        page.write("\nSee [the missing page](no-such-page.md).\n")
    done = build(tmp_path, tmp_path / "site")
    assert done.returncode != 0, "a link to a missing page did not fail the strict build"
    assert "no-such-page.md" in done.stdout + done.stderr


def test_the_configuration_reference_names_every_key():
    from hybridlab.config.schema import RunConfig

    text = REFERENCE.read_text()
    keys = config_keys(RunConfig)
    assert "actor.lr" in keys and "algorithm.kl_ctrl.kl_coef" in keys and "name" in keys
    missing = sorted(key for key in keys if f"`{key}`" not in text)
    print("keys missing from docs/configuration.md:", missing)
    assert not missing, f"docs/configuration.md does not name {missing}"


def test_the_configuration_reference_says_how_each_change_applies_as_the_schema_declares():
    """Each leaf key's row says what the schema declares (``setting``): step, live or recreate
    with the roles, remap, or fixed (every key of a section inherits what the section declares)."""
    import re

    from hybridlab.config.schema import config_fields

    fields = dict(config_fields())

    def declared(key: str) -> str:
        parents = [".".join(key.split(".")[:i]) for i in range(1, key.count(".") + 1)]
        if any(fields[p].metadata.get("change") == "fixed" for p in parents):
            return "fixed"
        meta = next((fields[p].metadata for p in parents if fields[p].metadata.get("change")), fields[key].metadata)
        change = meta.get("change", "step")
        return f"{change}: {', '.join(meta['workers'])}" if change in ("live", "recreate") else change

    rows = dict(re.findall(r"^\| `([\w.]+)` \| [^|]* \| ([^|]+?) \|", REFERENCE.read_text(), re.M))
    leaves = [k for k in fields if not any(other.startswith(k + ".") for other in fields)]
    assert {k: rows.get(k) for k in leaves} == {k: declared(k) for k in leaves}
    assert rows["actor.lr"] == "live: actor" and rows["rollout.kv_cache_mb"] == "recreate: rollout"
