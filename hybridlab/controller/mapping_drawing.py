"""A device mapping drawn in HTML: one row per pool, one box per device with the role ranks on it.

The notebook's mapping editor and the dashboard's Mapping and resharding section both show it.
"""
from __future__ import annotations

import html

from hybridlab.controller.mapping import DeviceMapping, rank_label

COLORS = ("#e3f2fd", "#fce4ec", "#e8f5e9", "#fff3e0", "#ede7f6", "#e0f7fa")


def draw(mapping: DeviceMapping) -> str:
    """Return HTML: one row per pool, one box per device, listing the role ranks on it; roles
    that share processes have the same color."""
    colors = {}
    for i, (_, members) in enumerate(mapping.process_sets()):
        for m in members:
            colors[m] = COLORS[i % len(COLORS)]
    rows, first = [], 0
    for name, pool in mapping.pools.items():
        boxes = []
        for d in range(pool.devices):
            lines = [f"<div style='background:{colors[r]};padding:1px 4px;margin:1px'>"
                     f"{html.escape(rank_label(r, lay, d))}</div>"
                     for r, lay in mapping.roles.items() if lay.pool == name and d < lay.world_size]
            boxes.append(f"<div style='border:1px solid #888;border-radius:4px;padding:3px;margin:2px;"
                         f"min-width:120px;font-size:12px'><b>device {first + d}</b>{''.join(lines) or '(idle)'}</div>")
        first += pool.devices
        nodes = f" on nodes labelled {labels_text(pool.node_labels)}" if pool.node_labels else ""
        rows.append(f"<div><b>{html.escape(name)}</b>{html.escape(nodes)}<div style='display:flex;flex-wrap:wrap'>"
                    f"{''.join(boxes)}</div></div>")
    return "".join(rows)


def labels_text(labels: dict) -> str:
    """Return node labels as ``key=value, ...``."""
    return ", ".join(f"{k}={v}" for k, v in labels.items())
