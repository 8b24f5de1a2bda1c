"""The device mapping and its remaps as the dashboard shows them: a line of text, a drawing,
and a table of every remap."""
from __future__ import annotations
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.mapping_drawing import draw


def mapping_text(mapping: dict) -> str:
    """Return a one-line Markdown summary of a device mapping: each pool with its roles."""
    pools = mapping.get("pools") or {}
    roles = mapping.get("roles") or {}
    parts = []
    for name, pool in pools.items():
        members = [f"{r} (tp{v.get('tp', 1)} pp{v.get('pp', 1)} dp{v.get('dp', 1)}"
                   f"{', colocated: ' + v['colocate'] if v.get('colocate') else ''})" for r, v in roles.items()
                   if v.get("pool") == name]
        parts.append(f"**{name}** ({pool.get('devices')} devices): {', '.join(members) or 'no roles'}")
    return "mapping: " + "; ".join(parts) if parts else ""


def mapping_html(mapping: dict) -> str:
    """Return the mapping drawn in HTML (a box per device), or "" for one that does not read."""
    try:
        return draw(DeviceMapping.from_dict(mapping))
    except Exception:  # an older or partial record: the one-line summary still shows it
        return ""


def remap_table(remaps: list[dict]) -> str:
    """Return an HTML table of the remaps, newest first: step, why, roles re-created, seconds, MB moved."""
    import html

    rows = "".join(f"<tr><td>{r.get('step', '')}</td><td>{html.escape(str(r.get('reason', 'remap')))}</td>"
                   f"<td>{html.escape(', '.join(r.get('roles_recreated') or []) or 'none')}</td>"
                   f"<td>{(r.get('seconds') or {}).get('total', 0.0):.1f}</td>"
                   f"<td>{r.get('bytes_moved', 0) / 2**20:.1f}</td></tr>" for r in reversed(remaps))
    head = "<tr><th>after step</th><th>why</th><th>re-created</th><th>seconds</th><th>MB moved</th></tr>"
    return f"<table>{head}{rows}</table>"
