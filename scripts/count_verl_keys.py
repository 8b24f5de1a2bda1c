"""Count the ``key=value`` settings of verl's example run scripts that call ``main_ppo``:

    python scripts/count_verl_keys.py VERL_CHECKOUT/examples 8

prints the number of scripts, then every key set in at least that many of them (a script counts
a key once; Hydra's ``+``/``++``/``~`` prefixes dropped), most used first, with its commonest
values. ``tests/verl_reference/example_keys.txt`` holds its output's keys for verl b178a3c."""
from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

SETTING = re.compile(r"(?:^|\s|['\"])(\+{0,2}~?[a-z_][a-z0-9_]*(?:\.[A-Za-z0-9_]+)+)=(\S*)")


def count(examples: Path) -> tuple[int, collections.Counter, dict]:
    """Return the scripts counted, how many set each key, and each key's values."""
    scripts = [p for p in examples.rglob("*.sh") if "main_ppo" in p.read_text(errors="ignore")]
    keys, values = collections.Counter(), collections.defaultdict(collections.Counter)
    for script in scripts:
        seen = set()
        for match in SETTING.finditer(script.read_text(errors="ignore")):
            key = match.group(1).lstrip("+~")
            seen.add(key)
            values[key][match.group(2)[:40]] += 1
        keys.update(seen)
    return len(scripts), keys, values


if __name__ == "__main__":
    n, keys, values = count(Path(sys.argv[1]))
    least = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    print(n, "scripts")
    for key, uses in keys.most_common():
        if uses >= least:
            print(uses, key, "|", ", ".join(v for v, _ in values[key].most_common(4)))
