"""RewardWorker: scores responses with rules, a user's function or a reward model.

``compute_reward`` (rules or function) and ``compute_model_reward`` return, per sample (an agent
trajectory is scored on its last model turn, the object field ``final_response``): ``token_level_scores`` (the score on the response's
last token, zeros elsewhere), ``acc`` (task accuracy where a rule scorer knows the data
source), ``reward_error`` (1 where the function raised) and the object fields
``reward_error_msg``, ``reward_extra_info`` (each sample's reward components, a dict) and
``reward_answer`` (the entries of the scorer's dict answer as verl records them, ``{}`` where
verl's scorer answers with a number: the validation metrics under verl's names read them). A raising reward function never stops the run: the sample gets
``error_score`` and is counted; with ``timeout_s`` a function that hangs is cut off.
"""
from __future__ import annotations

import torch

from hybridlab.batching import on_last_token
from hybridlab.config.schema import RewardConfig, SandboxConfig
from hybridlab.controller.worker import Dispatch, Worker, register
from hybridlab.protocol import Batch
from hybridlab.scorers import ScorerOptions
from hybridlab.workers.reward.scoring import RuleScorer, load_function, score_samples

KINDS = ("rule", "function", "model")  # "model" scores through compute_model_reward


class RewardWorker(Worker):
    """One rank of the reward role; ``kind`` picks the scorer."""

    def __init__(self, model_dir: str, kind: str = RewardConfig.kind, function: str | None = RewardConfig.function,
                 function_kwargs: dict | None = None,
                 format_score: float = RewardConfig.format_score, error_score: float = RewardConfig.error_score,
                 timeout_s: float = RewardConfig.timeout_s, gsm8k_extraction: str = RewardConfig.gsm8k_extraction,
                 math_verifier: str = RewardConfig.math_verifier, sandbox: SandboxConfig | None = None):
        from transformers import AutoTokenizer

        if kind not in KINDS:
            raise ValueError(f"unknown reward kind {kind!r}; choose one of: {', '.join(KINDS)}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.kind, self.error_score, self.timeout_s = kind, error_score, timeout_s
        self.rules = RuleScorer(ScorerOptions(format_score, gsm8k_extraction, math_verifier, sandbox or SandboxConfig()))
        self.fn = load_function(function, function_kwargs) if kind == "function" else self.rules
        self.reward_models: dict[str, object] = {}

    def _texts(self, batch: Batch) -> list[str]:
        if "final_response" in batch.objects:  # agent trajectories: the last model turn is the answer
            return list(batch.objects["final_response"])
        lengths = batch["response_mask"].sum(-1).tolist()
        return [self.tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
                for row, n in zip(batch["responses"], lengths)]

    @register(Dispatch.DP)
    def compute_reward(self, batch: Batch) -> Batch:
        """Return token_level_scores, acc, reward_error, reward_error_msg, reward_extra_info and
        reward_answer for the batch."""
        texts = self._texts(batch)
        n = len(batch)
        truths = batch.objects.get("ground_truth", [None] * n)
        sources = batch.objects.get("data_source", [""] * n)
        extras = batch.objects.get("extra_info", [None] * n)
        items = [(sources[i], text, truths[i], extras[i]) for i, text in enumerate(texts)]
        rows = score_samples(self.fn, self.rules, self.kind, items, self.error_score, self.timeout_s)
        scores = torch.tensor([r.score for r in rows], dtype=torch.float32)
        return Batch({"token_level_scores": on_last_token(scores, batch["response_mask"]),
                      "acc": torch.tensor([r.acc for r in rows], dtype=torch.float32),
                      "reward_error": torch.tensor([float(bool(r.error)) for r in rows])},
                     {"reward_error_msg": [r.error for r in rows], "reward_extra_info": [r.components for r in rows],
                      "reward_answer": [r.answer for r in rows]})

    @register(Dispatch.DP)
    @torch.no_grad()
    def compute_model_reward(self, batch: Batch, model: str) -> Batch:
        """Return token_level_scores from the sequence-classification reward model at ``model``
        (loaded on first use, so a reward-model stage can be added without a restart) and acc."""
        if self.reward_models.get(model) is None:
            from transformers import AutoModelForSequenceClassification

            self.reward_models[model] = AutoModelForSequenceClassification.from_pretrained(
                model, dtype=torch.float32).eval()
        out = self.reward_models[model](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                        position_ids=batch["position_ids"])
        texts = self._texts(batch)
        n = len(batch)
        truths = batch.objects.get("ground_truth", [None] * n)
        sources = batch.objects.get("data_source", [""] * n)
        acc = torch.tensor([self.rules.accuracy(s, t, g) for s, t, g in zip(sources, texts, truths)])
        return Batch({"token_level_scores": on_last_token(out.logits[:, 0].float(), batch["response_mask"]),
                      "acc": acc})

