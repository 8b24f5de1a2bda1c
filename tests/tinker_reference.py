"""A Tinker client's adapter trained in the test's process with plain transformers, peft and torch's
AdamW, and Tinker's losses written out apart from hybridlab's: what tests/test_tinker.py holds the
server to."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tinker import types

from hybridlab.config.training import LoraConfig
from hybridlab.tinker.adapters import ATTN, MLP, fresh_adapter
from hybridlab.workers.train import lora
from hybridlab.workers.train.fsdp_model import build_model

RANK, ALPHA, SEED = 4, 32.0, 0
ADAM = dict(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=0.0)


class Reference:
    """A client's adapter as the server should hold it, in the client's own shape (``rank`` on
    ``modules``): the same initialisation (``fresh_adapter`` from ``seed``), the same AdamW steps."""

    def __init__(self, model_dir: Path, rank: int = RANK, modules: list[str] = ATTN + MLP, seed: int = SEED):
        self.model = lora.add_adapter(build_model(str(model_dir), False), LoraConfig(
            rank=rank, alpha=ALPHA, target_modules=modules))
        self.params = [p for n, p in self.model.named_parameters() if lora.saved_name(n)]
        self.set_adapter(fresh_adapter({name: tuple(p.shape) for name, p in self.named().items()}, seed))
        self.opt = torch.optim.AdamW(self.params, lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]),
                                     eps=ADAM["eps"], weight_decay=ADAM["weight_decay"])

    def logprobs(self, tokens: list[int], targets: list[int]) -> torch.Tensor:
        ids = torch.tensor([[*tokens, targets[-1]]])
        logits = self.model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]

    def forward_backward(self, data: list[dict], loss: str, config: dict | None = None) -> tuple[list, float]:
        total, out = 0.0, []
        for d in data:
            logp = self.logprobs(d["tokens"], d["target_tokens"])
            value = formula(loss, logp, d, config or {})
            value.backward()
            total += float(value.detach())
            out.append(logp.detach())
        return out, total

    def load(self, state_file: Path) -> None:
        """Take the adapter and AdamW state a server saved (``save_state``): no drift from here."""
        state = torch.load(state_file, weights_only=False)
        self.set_adapter(state["model"])
        for name, p in self.named().items():
            self.opt.state[p] = {"step": torch.tensor(state["adam_step"]), "exp_avg": state["exp_avg"][name].clone(),
                                 "exp_avg_sq": state["exp_avg_sq"][name].clone()}

    def named(self) -> dict[str, torch.nn.Parameter]:
        return {lora.saved_name(n): p for n, p in self.model.named_parameters() if lora.saved_name(n)}

    def set_adapter(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.named().items():
                p.copy_(weights[name])

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def formula(loss: str, logp: torch.Tensor, d: dict, config: dict) -> torch.Tensor:
    """Tinker's documented loss on one datum, written out here apart from hybridlab's."""
    if loss == "cross_entropy":
        return -(logp * torch.tensor(d.get("weights", [1.0] * len(logp)))).sum()
    q, adv = torch.tensor(d["logprobs"]), torch.tensor(d["advantages"])
    ratio = torch.exp(logp - q)
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if loss == "importance_sampling":
        return -(ratio * adv).sum()
    if loss == "ppo":
        return -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv).sum()
    if loss == "cispo":
        return -(torch.clamp(ratio, low, high).detach() * logp * adv).sum()
    if loss == "dro":
        return -(logp * adv - 0.5 * config["beta"] * (logp - q) ** 2).sum()
    assert loss == "gspo"  # GSPO's paper: the sequence's ratio, its gradient carried by each token
    seq_ratio = torch.exp((logp - q).mean())
    token_ratio = seq_ratio.detach() * torch.exp(logp - logp.detach())
    return -torch.min(token_ratio * adv, torch.clamp(token_ratio, low, high) * adv).sum()


def datum(d: dict) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(d["tokens"]),
                       loss_fn_inputs={k: v for k, v in d.items() if k != "tokens"})


def rl_data(reference: Reference, rng: np.random.Generator) -> list[dict]:
    """Two sampled-looking datums: the reference's own log-probs, shifted, as the sampler's."""
    out = []
    for length in (7, 5):
        tokens = rng.integers(3, 200, length + 1).tolist()
        with torch.no_grad():
            q = reference.logprobs(tokens[:-1], tokens[1:]) + torch.tensor(rng.normal(0, 0.05, length))
        out.append({"tokens": tokens[:-1], "target_tokens": tokens[1:], "logprobs": q.float().tolist(),
                    "advantages": rng.normal(0, 1, length).round(3).tolist()})
    return out


LEVELS = iter(range(1_000_000))


def level(server, training, reference: Reference) -> None:
    """Load the server's exact adapter and AdamW state into the reference (``save_state``): the
    two drift apart by float rounding over many steps (more with one thread per process, as the
    suite runs), so each check after a step starts level."""
    name = f"level-{next(LEVELS)}"
    training.save_state(name).result()
    model_id = training.get_info().model_id
    reference.load(server.service.run_dir / model_id.replace(":", "_") / "weights" / name / "state.pt")


def assert_same_forward(training, reference: Reference, data: list[dict], atol: float) -> None:
    """The server's next forward equals the reference's: after a step on each side, equal
    log-probs mean the two took the same gradient."""
    after = training.forward([datum(d) for d in data], "cross_entropy").result()
    with torch.no_grad():
        for out, d in zip(after.loss_fn_outputs, data):
            want = reference.logprobs(d["tokens"], d["target_tokens"])
            np.testing.assert_allclose(out["logprobs"].to_numpy(), want.numpy(), atol=atol, rtol=0)
