"""TinkerService: Tinker's training clients and sampling sessions, run on hybridlab's workers.

One base model per service. Its worker set holds a sampler (``TinkerSampler``, vLLM with LoRA)
from the start and a LoRA trainer (``TinkerTrainer``, FSDP2) once a client creates a model,
both in one process on one device: the trainer's base weights and the sampler's are the same
checkpoint, and each saved sampler weight is an adapter the sampler holds under its own id.

Every method here blocks (worker calls); ``server.py`` runs training calls on one thread, in
each model's ``seq_id`` order, and sampling calls on another, batched.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import time
from pathlib import Path

import ray
import torch
from safetensors.torch import load_file, save_file

from hybridlab.atomic import atomic_dir
from hybridlab.config.training import ActorConfig, LoraConfig
from hybridlab.controller.group import RoleClass
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.resources import connect
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.environment import describe
from hybridlab.errors import UserError
from hybridlab.models.zoo import resolve_model
from hybridlab.telemetry.run import RunTelemetry
from hybridlab.tinker import wire
from hybridlab.tinker.adapters import ATTN, MLP, AdapterShape
from hybridlab.tinker.names import publish_tokenizer
from hybridlab.tinker.losses import INPUTS, check_loss, token_losses
from hybridlab.tinker.settings import ServiceSettings
from hybridlab.tinker.workers import INPUT_PREFIX, TinkerSampler, TinkerTrainer, datum_batch
from hybridlab.workers.train.settings import TrainSettings



@dataclasses.dataclass
class TrainingModel:
    """A training client's adapter on the trainer."""

    model_id: str
    lora: dict                      # Tinker's lora_config: rank, train_mlp, train_attn, train_unembed
    seed: int                       # its adapter's initialisation (adapters.fresh_adapter)


@dataclasses.dataclass
class Sampler:
    """A sampling session: the base model (adapter None) or saved sampler weights."""

    sampler_id: str
    adapter: int | None
    model_path: str | None


def base_model_name(settings: ServiceSettings, model_dir: Path) -> str:
    """Return the ``org/model`` name clients give as ``base_model``."""
    if settings.name:
        return settings.name
    stem = settings.model if "/" not in settings.model else model_dir.name
    return f"hybridlab/{re.sub(r'[^A-Za-z0-9._-]', '-', stem)}"


class TinkerService:
    """The models, samplers and saved weights of one served base model."""

    def __init__(self, settings: ServiceSettings):
        self.settings = settings.validate()
        self.model_dir = resolve_model(settings.model, seed=settings.seed)
        self.base_model = base_model_name(settings, self.model_dir)
        self.run_dir = Path(settings.run_dir)
        # each server's dashboard records apart (servers may share run_dir: a state saved by one
        # loads in the next): `hybridlab dashboard RUN_DIR/dashboards` lists them
        self.dashboard_dir = self.run_dir / "dashboards" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.telemetry = RunTelemetry(self.dashboard_dir)
        self.workers: WorkerSet | None = None
        self.models: dict[str, TrainingModel] = {}  # the training clients, by model id
        self.samplers: dict[str, Sampler] = {}
        self.adapters: collections.OrderedDict[int, str | None] = collections.OrderedDict()  # id -> saved path
        self.next_adapter = 2  # 1 is the RL actor's slot (vllm_engine.ADAPTER_ID); any positive id works
        config = json.loads((self.model_dir / "config.json").read_text())
        longest = int(config.get("max_position_embeddings", 0)) or settings.context
        if settings.context > longest:
            raise UserError(f"context={settings.context} is longer than {self.model_dir.name}'s"
                            f" max_position_embeddings ({longest}); give at most that, or 0 for it")
        self.context = settings.context or longest

    # ------------------------------------------------------------------ lifecycle
    def _mapping(self, roles: tuple[str, ...]) -> DeviceMapping:
        return DeviceMapping.from_dict({"pools": {"main": {"devices": 1}},
                                        "roles": {r: {"pool": "main", "colocate": "tinker"} for r in roles}})

    def start(self) -> "TinkerService":
        """Publish the model's tokenizer under its name, start the sampler's worker (the trainer
        comes with the first model) and the run's telemetry; returns self."""
        s = self.settings
        sampler = RoleClass(TinkerSampler, kwargs=dict(
            model_dir=str(self.model_dir), max_model_len=self.context, kv_cache_mb=s.kv_cache_mb, seed=s.seed,
            lora_rank=s.max_lora_rank, lora_slots=(s.batch_adapters, s.sampler_adapters)))
        publish_tokenizer(self.model_dir, self.base_model, s.hub_cache)  # the SDK loads it by name
        env: dict = {}
        mapping = self._mapping(("rollout", "actor"))
        connect()  # before the telemetry hub, an actor: Ray would start a cluster without our settings
        self.telemetry.start(env, {"name": f"tinker {self.base_model}", "processor": describe()["processor"],
                                   "backends": {"trainer": "fsdp2 (LoRA)", "sampler": "vllm (LoRA)"},
                                   "mapping": mapping.to_dict(), "explanation": self.explain()})
        self.workers = WorkerSet(self._mapping(("rollout",)), {"rollout": sampler}, env=env).start()
        self.telemetry.watch(self.workers, {})  # call spans and the calls in flight
        return self

    def explain(self) -> str:
        """Return what the service runs where, as Markdown (the dashboard's Config section)."""
        s = self.settings
        return (f"**{self.base_model}** ({self.model_dir}), context {self.context} tokens. One device, one process:"
                f" the **trainer** (a LoRA adapter of rank up to {s.max_lora_rank}, alpha {s.lora_alpha:g}, on the"
                " FSDP2 backend, built when a client creates a model) and the **sampler** (vLLM with LoRA:"
                f" {s.batch_adapters} adapters in a batch, {s.sampler_adapters} saved sampler weights held)."
                " Saved sampler weights reach the sampler through Ray's object store, adapter only;"
                f" `tinker://` paths are folders under `{self.run_dir}`.")

    @contextlib.contextmanager
    def timed(self, call: str, **fields):
        """Time the block and send the dashboard a ``service`` record of the call (with ``fields``,
        which the block may add to, and ``error`` when it raised)."""
        start = time.perf_counter()
        try:
            yield fields
        except BaseException as exc:
            fields["error"] = type(exc).__name__
            raise
        finally:
            self.telemetry.emit("service", {"call": call, "seconds": time.perf_counter() - start, **fields})

    def close(self) -> None:
        """Stop every worker of the service, then its telemetry (the records stay on disk)."""
        self.telemetry.stop_watching()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        self.telemetry.close()

    def capabilities(self) -> dict:
        """Return ``get_server_capabilities``' answer: the one model served."""
        return {"supported_models": [{"model_name": self.base_model, "max_context_length": self.context,
                                      "trainable": True, "sampleable": True}]}

    # ------------------------------------------------------------------ models
    def _check_base(self, base_model: str | None) -> None:
        if base_model and base_model not in (self.base_model, str(self.model_dir)):
            raise UserError(f"base_model {base_model!r} is not served here; this server offers {self.base_model!r}")

    def create_model(self, model_id: str, base_model: str | None, lora: dict, optimizer: dict | None) -> dict:
        """Register ``model_id`` with a fresh adapter (building the trainer for the first one);
        returns CreateModelResponse. Clients may ask for different ranks and modules: the
        trainer's adapter has the largest shape, and each client's sits in it (``adapters.py``)."""
        self._check_base(base_model)
        if optimizer and optimizer.get("type", "adamw") != "adamw":
            raise UserError(f"optimizer {optimizer.get('type')!r} is not served; this server trains with adamw")
        rank = int(lora.get("rank", 32))
        if not 1 <= rank <= self.settings.max_lora_rank:
            raise UserError(f"lora rank {rank} is outside 1..{self.settings.max_lora_rank}"
                            " (the server's max_lora_rank)")
        shape = {"rank": rank, "train_attn": lora.get("train_attn", True), "train_mlp": lora.get("train_mlp", True)}
        if not AdapterShape.of(shape).modules:
            raise UserError("train_attn and train_mlp are both false: the adapter would train nothing")
        if model_id in self.models:  # the SDK retried the call
            return {"model_id": model_id, "type": "create_model"}
        if not self.models:  # the first client builds the trainer, its adapter as large as any client's
            largest = LoraConfig(rank=self.settings.max_lora_rank, alpha=self.settings.lora_alpha,
                                 target_modules=ATTN + MLP)
            section = ActorConfig(strategy="fsdp2", micro_batch_tokens=0, remove_padding=False, warmup_steps=0,
                                  lora=largest)
            trainer = RoleClass(TinkerTrainer, kwargs=dict(
                model_dir=str(self.model_dir), settings=TrainSettings(section, self.settings.seed, 1.0)))
            self.workers.remap(self._mapping(("rollout", "actor")), {"actor": trainer})
        seed = int(lora["seed"]) if lora.get("seed") is not None else self.settings.seed + len(self.models)
        self.models[model_id] = TrainingModel(model_id, {**shape, "train_unembed": lora.get("train_unembed", True)},
                                              seed)
        return {"model_id": model_id, "type": "create_model"}

    def info(self, model_id: str) -> dict:
        """Return ``get_info``'s answer for ``model_id``: the base model's name and a tokenizer
        id that loads with no hub access (its checkpoint directory)."""
        model = self._trained(model_id, activate=False)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": model.lora["rank"],
                "model_name": self.base_model,
                "model_data": {"arch": "lora", "model_name": self.base_model, "tokenizer_id": str(self.model_dir)}}

    def _trained(self, model_id: str, activate: bool = True) -> TrainingModel:
        """Return the client ``model_id``, its adapter made the trainer's (``activate``)."""
        model = self.models.get(model_id)
        if model is None:
            raise UserError(f"unknown model_id {model_id!r} (this server holds: {', '.join(self.models) or 'none'})")
        if activate:
            self.trainer.activate(model_id, model.seed, AdapterShape.of(model.lora))
        return model

    @property
    def trainer(self):
        return self.workers.groups["actor"]

    @property
    def sampler(self):
        return self.workers.groups["rollout"]

    # ------------------------------------------------------------------ training
    def forward_backward(self, call: wire.FwdBwdCall) -> bytes:
        """Run one forward_backward (or forward) chunk; returns the ForwardBackwardOutput body
        with each datum's log-probs and ``loss:sum``."""
        kind = "forward" if call.forward_only else "forward_backward"
        with self.timed(kind, model=call.model_id, datums=len(call.tokens), loss_fn=call.loss_fn) as record:
            if not call.tokens:
                raise UserError(f"{kind} needs at least one datum")
            check_loss(call.loss_fn, call.config, set(call.inputs[0]), call.forward_only)
            longest = max(len(t) for t in call.tokens)
            if longest >= self.context:
                raise UserError(f"a datum of {longest} tokens does not fit the server's context of {self.context}")
            self._trained(call.model_id)  # checked first: activating swaps adapters
            batch = datum_batch(call.tokens, call.inputs)
            out = self.trainer.forward_backward(batch, None if call.forward_only else call.loss_fn, call.config)
            logprobs = out["logprobs"]
            inputs = {k.removeprefix(INPUT_PREFIX): v for k, v in batch.tensors.items() if k.startswith(INPUT_PREFIX)}
            loss = 0.0 if call.forward_only and set(INPUTS[call.loss_fn][0]) - set(inputs) else \
                float(token_losses(call.loss_fn, logprobs, inputs, batch["response_mask"], call.config).sum())
            record["loss_sum"] = loss
        per_datum = [logprobs[i, :len(t)].numpy() for i, t in enumerate(call.tokens)]
        return wire.forward_backward_output(per_datum, {"loss:sum": loss})

    def optim_step(self, model_id: str, adam: dict) -> dict:
        """Apply the accumulated gradients with ``adam`` (AdamParams); returns OptimStepResponse."""
        with self.timed("optim_step", model=model_id, lr=adam.get("learning_rate")):
            self._trained(model_id)
            out = self.trainer.optim_step(adam)[0]
        return {"metrics": {"grad_norm:mean": out["grad_norm"], "skipped:sum": out["skipped"]}}

    def _folder(self, model_id: str, kind: str, name: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise UserError(f"checkpoint name {name!r}: use letters, digits, '.', '_' and '-'")
        return self.run_dir / model_id.replace(":", "_") / kind / name

    def _path_folder(self, path: str) -> Path:
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") \
                or not all(re.fullmatch(r"[A-Za-z0-9._:-]+", p) and p not in (".", "..") for p in parts):
            raise UserError(f"{path!r} is not a tinker:// path of this server (tinker://<model>/weights/<name> or"
                            " tinker://<model>/sampler_weights/<name>)")
        folder = self.run_dir / parts[0].replace(":", "_") / parts[1] / parts[2]
        if not folder.is_dir():
            raise UserError(f"{path}: nothing saved there (looked in {folder})")
        return folder

    def save_state(self, model_id: str, name: str, overwrite: bool = False) -> dict:
        """Save the adapter and its AdamW state under ``name`` (replacing one of that name only
        with ``overwrite``); returns SaveWeightsResponse."""
        model = self._trained(model_id)
        folder = self._folder(model_id, "weights", name)
        if folder.exists() and not overwrite:
            raise UserError(f"a state named {name!r} exists already for {model_id}; save under another name"
                            " (or with overwrite=True)")
        state = next(s for s in self.trainer.checkpoint_state() if s is not None)
        with atomic_dir(folder) as tmp:  # whole: a reader never sees half a state
            torch.save(state, tmp / "state.pt")
            (tmp / "model.json").write_text(json.dumps({"base_model": self.base_model, "lora": model.lora}))
        return {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}

    def load_state(self, model_id: str, path: str, optimizer: bool, session: tuple[str, int] | None = None) -> dict:
        """Load a saved state (with its AdamW moments when ``optimizer``) into ``model_id``, first
        creating the model from the saved LoRA settings when ``session`` (create-via-load)."""
        folder = self._path_folder(path)
        saved = json.loads((folder / "model.json").read_text())
        if session is not None:
            self.create_model(model_id, saved["base_model"], saved["lora"], None)
        model = self._trained(model_id)
        if AdapterShape.of(saved["lora"]) != AdapterShape.of(model.lora):
            raise UserError(f"{path} holds an adapter of {AdapterShape.of(saved['lora'])}; {model_id} trains one of"
                            f" {AdapterShape.of(model.lora)}")
        state = torch.load(folder / "state.pt", weights_only=False)
        if not optimizer:
            state = {k: v for k, v in state.items() if k not in ("exp_avg", "exp_avg_sq")}
        self.trainer.load_state([ray.put([state])])
        self.trainer.clear_gradients()
        return {"path": path, "model_id": model_id, "type": "load_weights"}

    # ------------------------------------------------------------------ sampling
    def _keep(self, tensors_ref, path: str | None) -> int:
        adapter_id, self.next_adapter = self.next_adapter, self.next_adapter + 1
        self.adapters[adapter_id] = path
        evict = []
        while len(self.adapters) > self.settings.sampler_adapters:
            evict.append(self.adapters.popitem(last=False)[0])
        self.sampler.keep_adapter(adapter_id, [tensors_ref], evict)
        return adapter_id

    def save_for_sampler(self, model_id: str, name: str | None) -> tuple[int, str | None]:
        """Put the adapter as it is now in the sampler under a new id, and on disk under ``name``
        (PEFT's format) when given; returns (adapter id, tinker:// path or None)."""
        self._trained(model_id)
        ref, _ = next(r for r in self.trainer.export_adapter() if r is not None)
        path = None
        if name is not None:
            tensors, config = ray.get(ref)
            folder = self._folder(model_id, "sampler_weights", name)
            with atomic_dir(folder) as tmp:
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"))
                (tmp / "adapter_config.json").write_text(json.dumps(config))
            path = f"tinker://{model_id}/sampler_weights/{name}"
        return self._keep(ref, path), path

    def add_sampler(self, sampler_id: str, base_model: str | None, model_path: str | None,
                    adapter: int | None = None) -> Sampler:
        """Register a sampling session on the base model, on saved sampler weights (``model_path``)
        or on an adapter the sampler holds; returns it."""
        if model_path and adapter is None:
            adapter = next((a for a, p in self.adapters.items() if p == model_path), None)
            if adapter is None:  # saved earlier, or by another server: read it back
                folder = self._path_folder(model_path)
                tensors = load_file(str(folder / "adapter_model.safetensors"))
                config = json.loads((folder / "adapter_config.json").read_text())
                adapter = self._keep(ray.put((tensors, config)), model_path)
        elif not model_path:
            self._check_base(base_model)
        sampler = Sampler(sampler_id, adapter, model_path)
        self.samplers[sampler_id] = sampler
        self.telemetry.emit("service", {"call": "create_sampler", "seconds": 0.0, "sampler": sampler_id})
        return sampler

    def sample_many(self, requests: list[dict]) -> list[dict | Exception]:
        """Sample every request (``sampling_session_id``, ``prompt``, ``num_samples``,
        ``sampling_params``, ``prompt_logprobs``) in one engine call; returns each one's
        answer, or the error that refused it."""
        answers: list[dict | Exception] = [None] * len(requests)
        work, where = [], []
        for i, req in enumerate(requests):
            try:
                work.append(self._sample_request(req))
                where.append(i)
            except UserError as exc:
                answers[i] = exc
        if work:
            for i, answer in zip(where, self.sampler.sample_many(work)[0]):
                answers[i] = answer
        return answers

    def _sample_request(self, req: dict) -> dict:
        sampler = self.samplers.get(req.get("sampling_session_id") or "")
        if sampler is None:
            raise UserError(f"unknown sampling_session_id {req.get('sampling_session_id')!r}")
        if sampler.adapter is not None and sampler.adapter not in self.adapters:
            raise UserError(f"the sampler weights of {sampler.sampler_id} were evicted (the server keeps the last"
                            f" {self.settings.sampler_adapters}: sampler_adapters); save them again")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if req.get(key):
                raise UserError(f"{key} is not served by this server (top-k log-probs)")
        prompt = wire.model_input_tokens(req["prompt"])
        params = dict(req.get("sampling_params") or {})
        room = self.context - len(prompt)
        if room < 1 or (params.get("max_tokens") or 1) > room:
            raise UserError(f"a prompt of {len(prompt)} tokens with max_tokens={params.get('max_tokens')} does not"
                            f" fit the server's context of {self.context}")
        return {"prompt": prompt, "num_samples": int(req.get("num_samples", 1)), "params": params,
                "adapter": sampler.adapter, "prompt_logprobs": bool(req.get("prompt_logprobs"))}

