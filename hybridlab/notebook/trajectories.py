"""TrajectoryView: an agent step's trajectories token by token, coloured by who wrote each token
(the prompt, the model, a tool, the environment, the template's turn markers), with each
token's sampled log-prob and policy version on hover, and the trajectory's reward."""
from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from hybridlab.agents.trajectory import SOURCES
from hybridlab.protocol import Batch

COLOURS = {"prompt": "#e8e8e8", "model": "#c8f0c8", "tool": "#cfe0ff", "env": "#ffe2b8", "user": "#f3d0f0",
           "template": "#f4f4d0"}


def token_rows(batch: Batch, row: int, tokenizer: Any) -> list[dict]:
    """Return one trajectory's tokens in order: ``text``, ``source``, ``logprob`` and
    ``version`` (None for tokens the model did not sample)."""
    prompt = batch["prompts"][row][batch["attention_mask"][row, :batch["prompts"].shape[1]].bool()].tolist()
    out = [{"text": tokenizer.decode([t]), "source": "prompt", "logprob": None, "version": None} for t in prompt]
    width = int(batch["attention_mask"][row, batch["prompts"].shape[1]:].sum())
    for j in range(width):
        source = SOURCES[int(batch["token_sources"][row, j])]
        model = source == "model"
        out.append({"text": tokenizer.decode([int(batch["responses"][row, j])]), "source": source,
                    "logprob": float(batch["rollout_log_probs"][row, j]) if model else None,
                    "version": int(batch["rollout_versions"][row, j]) if model else None})
    return out


def trajectory_html(tokens: list[dict], reward: float) -> str:
    """Return the HTML of one trajectory: its reward, a legend, and its tokens as coloured spans."""
    legend = " ".join(f"<span style='background:{c};padding:0 4px'>{s}</span>" for s, c in COLOURS.items())
    spans = []
    for t in tokens:
        tip = t["source"] + ("" if t["logprob"] is None else f", log-prob {t['logprob']:.4f}, version {t['version']}")
        spans.append(f"<span class='tok-{t['source']}' title='{html.escape(tip, quote=True)}' style='background:"
                     f"{COLOURS[t['source']]};white-space:pre-wrap'>{html.escape(t['text'])}</span>")
    return (f"<div><b>reward {reward:.4g}</b> &nbsp; {legend}</div>"
            f"<div style='font-family:monospace;line-height:1.6'>{''.join(spans)}</div>")


class TrajectoryView(widgets.VBox):
    """Pick a trajectory of an agent step's batch; see its tokens by source."""

    def __init__(self, batch: Batch, tokenizer: Any):
        self.batch, self.tokenizer = batch, tokenizer
        rewards = batch["token_level_scores"].sum(-1).tolist() if "token_level_scores" in batch else [0.0] * len(batch)
        self.rewards = rewards
        self.pick = widgets.Dropdown(options=[(f"{i}: reward {r:.3g}", i) for i, r in enumerate(rewards)],
                                     value=0, description="trajectory")
        self.view = widgets.HTML()
        self.pick.observe(lambda _: self.render(), "value")
        self.render()
        super().__init__([self.pick, self.view])

    def render(self) -> None:
        """Redraw the chosen trajectory."""
        row = self.pick.value
        self.view.value = trajectory_html(token_rows(self.batch, row, self.tokenizer), self.rewards[row])
