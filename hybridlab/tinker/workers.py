"""The Tinker service's two roles: a LoRA trainer on the FSDP2 backend and a vLLM sampler.

Both are hybridlab's own workers (``ActorWorker``, ``RolloutWorker``) with the calls Tinker
splits apart: the RL step runs forward, backward and the optimizer step in one call, while
Tinker's ``forward_backward`` only adds gradients and ``optim_step`` applies them with the
Adam settings the client sends.

A datum travels as one row (``datum_batch``): ``model_input`` followed by its last target
token as ``input_ids`` and the targets as ``responses``, so the engine's "response log-probs"
are exactly Tinker's per-position log-probs (position i predicts ``target_tokens[i]``).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import distribute_tensor

from hybridlab.controller.worker import Dispatch, register
from hybridlab.protocol import PAD_KEY, Batch
from hybridlab.tinker.adapters import AdapterShape, fresh_adapter
from hybridlab.tinker.losses import engine_loss
from hybridlab.workers.rollout.worker import RolloutWorker
from hybridlab.workers.rollout.vllm_engine import (adapter_request, empty_prefix_cache, installed_adapters,
                                                   load_adapter, per_request_seeds, sampled_logprobs)
from hybridlab.workers.train.fsdp_engine import MOMENTS
from hybridlab.workers.train.lora import ADAPTER
from hybridlab.workers.train.workers import ActorWorker

INPUT_PREFIX = "tinker/"  # a loss input's tensor name in the batch: tinker/weights, tinker/advantages, ...


def datum_batch(tokens: list, inputs: list[dict]) -> Batch:
    """Return the Batch of Tinker datums: ``tokens`` their model inputs, ``inputs`` their
    ``loss_fn_inputs`` (``target_tokens`` and each other key, one value per position; arrays or
    lists), right-padded to the longest datum; ``response_mask`` is 1 on each datum's positions."""
    width = max(len(t) for t in tokens)
    n = len(tokens)
    input_ids = torch.zeros(n, width + 1, dtype=torch.long)
    attention = torch.zeros(n, width + 1, dtype=torch.long)
    targets = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.float32)
    extra = {key: torch.zeros(n, width, dtype=torch.float32) for key in inputs[0] if key != "target_tokens"}
    for i, (ids, row) in enumerate(zip(tokens, inputs)):
        length, target = len(ids), torch.tensor(row["target_tokens"], dtype=torch.long)
        input_ids[i, :length] = torch.tensor(ids, dtype=torch.long)
        input_ids[i, length] = target[-1]
        attention[i, :length + 1] = 1
        targets[i, :length] = target
        mask[i, :length] = 1
        for key, values in row.items():
            if key != "target_tokens":
                extra[key][i, :length] = torch.tensor(values, dtype=torch.float32)
    return Batch({"input_ids": input_ids, "attention_mask": attention, "responses": targets, "response_mask": mask,
                  **{INPUT_PREFIX + k: v for k, v in extra.items()}})


class TinkerTrainer(ActorWorker):
    """LoRA adapters and their AdamW states on the FSDP2 backend, driven by Tinker's calls.

    Several training clients share the base weights: the engine holds one adapter at a time, of
    the largest shape a client may ask for, and ``activate`` swaps in a client's adapter
    (zero-padded to it, ``adapters.py``), AdamW moments, step and accumulated gradients before
    each of its calls (an adapter is small: the swap copies a few MB in this process). Whatever
    leaves the worker (a saved state, sampler weights) is in the client's own shape.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.active: str | None = None  # the client whose adapter the engine holds
        self.held: dict[str, dict] = {}  # the other clients': model id -> what _stash returned
        self.shapes: dict[str, AdapterShape] = {}  # every client's adapter shape
        self.full = {name: tuple(p.shape) for name, p in self.engine.saved.items()}  # the engine's
        if self.engine.dp != 1:  # the swaps read whole tensors on rank 0 only: one device, as the service maps it
            raise ValueError(f"the Tinker trainer runs on one device; this one has dp {self.engine.dp}")

    @register(Dispatch.ALL)
    def activate(self, model_id: str, seed: int, shape: AdapterShape) -> bool:
        """Make ``model_id``'s adapter (of ``shape``) the engine's, stashing the active client's;
        a client seen for the first time gets a fresh adapter drawn from ``seed``. Returns
        whether anything was swapped."""
        if self.active == model_id:
            return False
        if self.active is not None:
            self.held[self.active] = self._stash()
        self.shapes[model_id] = shape
        self._restore(self.held.pop(model_id, None) or self._fresh(shape, seed), shape)
        self.active = model_id
        return True

    def _shape(self) -> AdapterShape:
        if self.active is None:
            raise RuntimeError("no training client is active on the Tinker trainer: activate() one first")
        return self.shapes[self.active]

    def _stash(self) -> dict:
        engine, shape = self.engine, self._shape()
        state = engine.state(moments=True)
        grads = shape.cut({name: None if p.grad is None else p.grad.detach().full_tensor()
                           for name, p in engine.saved.items()})
        return {"adam_step": state.get("adam_step", 0.0), **_own(state, shape), "step": engine.step_count,
                "grads": grads}

    def _fresh(self, shape: AdapterShape, seed: int) -> dict:
        return {"model": fresh_adapter(shape.shapes(self.full), seed), "step": 0, "grads": {}}

    def _load(self, state: dict, shape: AdapterShape) -> None:
        """Load ``state`` (weights, moments if any, step; the client's shape) into the engine,
        padded; without moments (a fresh adapter, a weights-only load) AdamW starts afresh."""
        engine = self.engine
        for p in engine.saved.values():
            engine.optimizer.state.pop(p, None)
        moments = {m: shape.pad(state[m], self.full) for m in MOMENTS if state.get(m)}
        engine.load_state(shape.pad(state["model"], self.full), moments, state["step"], state.get("adam_step", 0.0))

    def _restore(self, state: dict, shape: AdapterShape) -> None:
        engine = self.engine
        self._load(state, shape)
        # only the client's own weights get back the gradient they had (None stays None); the padding's
        # stays None too, so an optim_step with nothing accumulated steps nothing
        grads = {name: None if g is None else shape.pad_one(name, g, self.full[name])
                 for name, g in state["grads"].items()}
        for name, p in engine.saved.items():  # each rank keeps its own rows of the whole gradient
            whole = grads.get(name)
            p.grad = None if whole is None else distribute_tensor(whole.to(p.device, p.dtype), p.device_mesh,
                                                                  p.placements, src_data_rank=None)
        for layer in engine.lora_layers.values():  # the client's alpha / rank, not the engine's
            layer.scaling[ADAPTER] = engine.lora.alpha / shape.rank

    @register(Dispatch.ALL)
    def checkpoint_state(self) -> dict | None:
        """Return the active client's adapter, AdamW moments, step and RNG, in its own shape."""
        state = super().checkpoint_state()
        if state is None:
            return None
        shape = self._shape()
        return {**state, **_own(state, shape), "adapter_config": shape.peft_config(state["adapter_config"], self.engine.lora.alpha)}

    @register(Dispatch.ALL)
    def load_state(self, boxed: list) -> None:
        """Load ``[ObjectRef of [state]]``, a state ``checkpoint_state`` returned (the active
        client's shape), into the active client's adapter; returns nothing. Without moments the
        weights alone load, and AdamW starts afresh."""
        import ray

        state = ray.get(boxed[0])[0]
        self._load(state, self._shape())
        torch.set_rng_state(state["rng"])

    @register(Dispatch.ALL)
    def export_adapter(self) -> tuple | None:
        """Put the active client's adapter (its own shape, PEFT's file names and config) in Ray's
        object store from rank 0; returns (reference, bytes) there, None elsewhere."""
        import ray

        tensors, config = self.engine.adapter()
        if self.rank != 0:
            return None
        shape = self._shape()
        own = shape.cut(tensors)
        return (ray.put((own, shape.peft_config(config, self.engine.lora.alpha))),
                sum(t.numel() * t.element_size() for t in own.values()))

    @register(Dispatch.DP)
    def forward_backward(self, batch: Batch, loss: str | None, config: dict | None) -> Batch:
        """Return each datum's per-position log-probs (``logprobs``); with ``loss`` (None: a
        forward pass only) add that loss's gradient to the adapter's."""
        pad = batch.meta.get(PAD_KEY, 0)
        if pad:  # the DP split repeated real rows to even out the ranks: they must not train twice
            batch.tensors["response_mask"][-pad:] = 0
        if loss is None:
            return Batch({"logprobs": self.engine.forward(batch, self.micro_batch_size)["log_probs"]})
        logprobs, _ = self.engine.accumulate(batch, engine_loss(loss, config), self.micro_batch_size)
        return Batch({"logprobs": logprobs})

    @register(Dispatch.ALL)
    def optim_step(self, adam: dict) -> dict[str, float]:
        """Apply the accumulated gradients with Tinker's ``AdamParams`` (learning_rate, beta1,
        beta2, eps, weight_decay, grad_clip_norm: 0 no clipping) and clear them; returns
        grad_norm, lr and skipped."""
        engine = self.engine
        engine.optim_cfg.lr, engine.optim_cfg.grad_clip = adam["learning_rate"], adam.get("grad_clip_norm", 0.0)
        engine.optim_cfg.warmup_steps, engine.optim_cfg.total_steps = 0, 0  # the client sends each step's rate
        for group in engine.optimizer.param_groups:
            group.update(betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"], weight_decay=adam["weight_decay"])
        out = engine.step_optimizer()
        engine.optimizer.zero_grad(set_to_none=True)
        return out

    @register(Dispatch.ALL)
    def clear_gradients(self) -> None:
        """Drop gradients accumulated since the last ``optim_step`` (a loaded state starts clean)."""
        self.engine.optimizer.zero_grad(set_to_none=True)


def _own(state: dict, shape: AdapterShape) -> dict:
    """Return the engine's ``state`` weights and moments cut to a client's ``shape``."""
    return {key: shape.cut(state[key]) for key in ("model", *MOMENTS) if key in state}


def _stop_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


class TinkerSampler(RolloutWorker):
    """vLLM in this process, sampling many clients' requests in one batch, each through the
    adapter its sampling client was made from (vLLM mixes adapters in a batch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # adapter id -> (tensors, PEFT config): reinstalled when vLLM has evicted it
        self.saved: dict[int, tuple[dict, dict]] = {}

    @register(Dispatch.ALL)
    def keep_adapter(self, adapter_id: int, boxed: list, evict: list[int]) -> int:
        """Hold the adapter ``[ObjectRef of (tensors, config)]`` under ``adapter_id``, install it
        in the engine, and forget the ids in ``evict``; returns the layers it adapts."""
        import ray

        tensors, config = ray.get(boxed[0])
        for old in evict:
            self.saved.pop(old, None)
        self.saved[adapter_id] = (tensors, config)
        return load_adapter(self.llm, tensors, config, adapter_id)

    def _ensure_installed(self, ids: set[int]) -> None:
        missing = ids - installed_adapters(self.llm)
        for adapter_id in sorted(missing):
            load_adapter(self.llm, *self.saved[adapter_id], adapter_id)

    @register(Dispatch.ALL)
    def sample_many(self, requests: list[dict]) -> list[dict]:
        """Sample every request in one engine call; each request holds ``prompt`` (token ids),
        ``num_samples``, ``params`` (Tinker's SamplingParams as a dict), ``adapter`` (an id given
        to ``keep_adapter``, or None: the base model) and ``prompt_logprobs`` (bool). Returns per
        request ``sequences`` [{tokens, logprobs, stop_reason}] and ``prompt_logprobs`` (None first)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        empty_prefix_cache(self.llm)  # blocks computed under earlier weights are never reused
        self._ensure_installed({r["adapter"] for r in requests if r.get("adapter") is not None})
        prompts, params, adapters = [], [], []
        for req in requests:
            p = req["params"]
            stop = p.get("stop")
            stop = [stop] if isinstance(stop, (str, int)) else list(stop or [])
            strings, ids = [s for s in stop if isinstance(s, str)], [s for s in stop if isinstance(s, int)]
            ends = [] if p.get("stop") == [] else self.stop_ids  # Tinker: stop=[] turns off even the end token
            max_tokens = p.get("max_tokens") or self.context - len(req["prompt"])
            params.append(SamplingParams(
                n=req["num_samples"], temperature=p.get("temperature", 1.0), top_p=p.get("top_p", 1.0),
                top_k=max(p.get("top_k", -1), 0), max_tokens=max_tokens, logprobs=0,
                # vLLM 0.32's CPU backend fails seeded requests whose prompt is prefilled in parts
                seed=p.get("seed") if per_request_seeds() else None,
                stop=strings or None, stop_token_ids=[*ends, *ids], ignore_eos=not ends, detokenize=bool(strings),
                prompt_logprobs=0 if req.get("prompt_logprobs") else None))
            prompts.append(TokensPrompt(prompt_token_ids=list(req["prompt"])))
            adapters.append(adapter_request(req["adapter"]) if req.get("adapter") is not None else None)
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
        return [_answer(out) for out in outputs]


def _answer(out) -> dict:
    sequences = []
    for completion in out.outputs:
        tokens, logprobs = sampled_logprobs(completion)
        sequences.append({"tokens": tokens, "logprobs": logprobs,
                          "stop_reason": _stop_reason(completion.finish_reason)})
    prompt = None
    if out.prompt_logprobs is not None:
        ids = out.prompt_token_ids
        prompt = [None] + [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])]
    return {"sequences": sequences, "prompt_logprobs": prompt}
