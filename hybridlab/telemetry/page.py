"""Where the dashboard's parts go: its sections, and the page that holds them.

Served, the dashboard is a Panel ``BootstrapTemplate`` (it loads nothing from outside the
server): the header carries the status line (run, phase, step, paused, processor, backends),
the sidebar the display settings (smoothing, x axis, runs to overlay) and, for users allowed to
use them, the run controls; the main area the sections as tabs. In a notebook cell the same
parts stack in one column. ``docs/dashboard.md`` describes each section.
"""
from __future__ import annotations

STUCK = "Stuck calls"


def sections(board) -> dict:
    """Return what each section (tab) of ``board`` (a ``dashboard.Dashboard``) shows, in order."""
    import panel as pn

    row = dict(sizing_mode="stretch_width")
    return {
        "Overview": pn.Column(board.memory.alarm, pn.Row(board.reward_fig, board.training.time_fig, **row),
                              pn.Row(board.rollout.speed, board.busy.fig, **row), board.mapping_pane, **row),
        "Rollouts": pn.Column(board.rollout.lengths, board.stream.layout, board.agent.layout, **row),
        "Training": pn.Column(board.training.layout, board.mismatch.layout, board.moe.layout, **row),
        "Mapping and resharding": pn.Column(board.advice.layout, board.mapping_drawing,
                                            pn.Row(board.reshard.fig, pn.Column(board.reshard.caption, **row), **row),
                                            board.sync_fig, pn.pane.Markdown("**Remaps**"), board.remap_table, **row),
        "System": pn.Column(board.devices.fig, board.memory.fig, board.memory.heat.fig, board.gantt_fig, **row),
        STUCK: board.running.layout,
        "Service": board.service.layout,
        "Config": board.explanation,
    }


def settings(board) -> list:
    """Return the display settings: smoothing, x axis, the other runs to overlay."""
    import panel as pn

    return [board.smoothing, pn.pane.Markdown("x axis of the per-step curves"), board.x_axis, board.compare]


def inline(board):
    """Return the notebook layout of ``board``: status, settings and controls in a row, sections."""
    import panel as pn

    row = dict(sizing_mode="stretch_width")
    controls = [pn.Row(*board.controls.buttons.values(), board.controls.message)] if board.controls else []
    return pn.Column(board.status, pn.Row(*settings(board), **row), *controls, board.tabs, **row)


def template_page(board):
    """Return the served page of ``board``: a Panel template with header, sidebar and sections."""
    import panel as pn

    sidebar = [pn.pane.Markdown("**Display**"), *settings(board)]
    if board.controls is not None:
        sidebar.append(board.controls.layout)
    return pn.template.BootstrapTemplate(title=f"hybridlab · {board.run_name}", header=[board.status],
                                         sidebar=sidebar, main=[board.tabs], sidebar_width=280,
                                         header_background="#2f4f6f")
