"""Which training backend each role runs on, and the checks of the settings that depend on it:
the strategy against the mapping's layout, LoRA (``actor.lora``) and FSDP offload
(``actor.fsdp``, ``critic.fsdp``). ``run_config.validate_config`` runs them with the rest."""
from __future__ import annotations

from pathlib import Path

from hybridlab.config import RunConfig
from hybridlab.config.bounds import one_of
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.errors import UserError
from hybridlab.models.spec import ModelSpec
from hybridlab.models.zoo import CONVERTED, model_config, parse_preset
from hybridlab.workers.train.backend import PRECISIONS, STRATEGIES, resolve_strategy
from hybridlab.workers.train.lora import SYNC_MODES

MAX_VLLM_LORA_RANK = 512  # vLLM 0.32's largest max_lora_rank (vllm.config.lora.MaxLoRARanks)


def backend_problems(cfg: RunConfig, mapping: DeviceMapping) -> list[str]:
    """Return every problem of the backend, LoRA and offload settings with ``mapping``, each naming its key."""
    return [*_strategy_problems(cfg, mapping), *_lora_problems(cfg, mapping), *_fsdp_problems(cfg, mapping)]


def training_problems(cfg: RunConfig) -> list[str]:
    """Return the problems of the actor's and critic's precision and strategy, and of the model
    for the strategies asked (Megatron trains the families it converts), each naming its key."""
    p = []
    for section in ("actor", "critic"):
        p += one_of(f"{section}.precision", getattr(cfg, section).precision, PRECISIONS)
        p += one_of(f"{section}.strategy", getattr(cfg, section).strategy, STRATEGIES)
    try:
        p += _model_problems(cfg)
    except UserError as exc:
        p.append(f"model: {exc}")
    return p


def _model_problems(cfg: RunConfig) -> list[str]:
    megatron = [s for s in ("actor", "critic") if getattr(cfg, s).strategy == "megatron"]
    if not Path(cfg.model).is_dir():
        arch = parse_preset(cfg.model)[1]
        return [f"{section}.strategy: the zoo's {arch} models have no Megatron conversion; use auto or fsdp2"
                for section in megatron if arch not in CONVERTED]
    if not (Path(cfg.model) / "config.json").is_file():
        return [f"model: {cfg.model} is not a Hugging Face checkpoint directory (no config.json)"]
    if not ModelSpec.read(cfg.model).converted and megatron:  # read raises if transformers cannot build it
        try:
            ModelSpec.from_hf(cfg.model)
        except UserError as exc:
            raise UserError(f"{exc} ({megatron[0]}.strategy=megatron; auto or fsdp2 trains it with FSDP2)") from None
    return []


def training_strategy(cfg: RunConfig, section: str) -> str:
    """Return the backend that trains ``section`` ("actor", whose backend the reference shares,
    or "critic"): its ``strategy``, with ``auto`` resolved for the run's model."""
    strategy = getattr(cfg, section).strategy
    if section == "actor" and cfg.actor.lora.rank > 0 and strategy == "auto":
        return "fsdp2"  # LoRA runs on the fsdp2 backend
    if strategy == "auto" and not Path(cfg.model).is_dir():  # a zoo name: its family says
        try:
            return "megatron" if parse_preset(cfg.model)[1] in CONVERTED else "fsdp2"
        except UserError:
            return "megatron"  # the model's own check names the bad name
    return resolve_strategy(strategy, cfg.model)


def _model_type(model: str) -> str | None:
    """Return the model_type of a checkpoint directory or zoo name (None if unreadable)."""
    import json

    try:
        if Path(model).is_dir():
            return json.loads((Path(model) / "config.json").read_text()).get("model_type")
        return model_config(*parse_preset(model)).model_type
    except (OSError, ValueError, UserError):
        return None


def _strategy_problems(cfg: RunConfig, mapping: DeviceMapping) -> list[str]:
    p: list[str] = []
    for section in ("actor", "critic"):
        if (section in mapping.roles or section == "actor" and "ref" in mapping.roles) \
                and getattr(cfg, section).strategy in STRATEGIES and _model_type(cfg.model) == "qwen3_moe" \
                and training_strategy(cfg, section) == "fsdp2":
            p.append(f"{section}.strategy: the fsdp2 backend does not train Qwen3-MoE (transformers 5 fuses each"
                     " layer's experts into one tensor, which its weight sync and checkpoints do not map); use"
                     f" {section}.strategy=megatron or auto")
    for role, layout in mapping.roles.items():
        section = {"actor": "actor", "ref": "actor", "critic": "critic"}.get(role)
        if section is None or getattr(cfg, section).strategy not in STRATEGIES:
            continue
        if layout.ep > 1 and (training_strategy(cfg, section) == "fsdp2" or section == "actor" and cfg.actor.lora.rank):
            p.append(f"mapping.roles.{role}: ep={layout.ep} is Megatron's expert parallelism, and {section} trains on"
                     f" the fsdp2 backend; use {section}.strategy=megatron (an MoE family it converts) or ep: 1")
        if layout.tp * layout.pp == 1:
            continue
        if section == "actor" and cfg.actor.lora.rank > 0:
            p.append(f"mapping.roles.{role}: tp={layout.tp}, pp={layout.pp}, but LoRA (actor.lora.rank) runs on the"
                     f" fsdp2 backend, which shards over data-parallel ranks only (tp and pp must be 1, use dp)")
        elif training_strategy(cfg, section) == "fsdp2":
            p.append(f"mapping.roles.{role}: tp={layout.tp}, pp={layout.pp} needs {section}.strategy=megatron; the"
                     f" fsdp2 backend shards over data-parallel ranks only (tp and pp must be 1, use dp)")
    return p


def _fsdp_problems(cfg: RunConfig, mapping: DeviceMapping) -> list[str]:
    p: list[str] = []
    for section in [s for s in ("actor", "critic") if s in mapping.roles]:
        offload = [k for k, v in vars(getattr(cfg, section).fsdp).items() if v]
        if offload and getattr(cfg, section).strategy in STRATEGIES and training_strategy(cfg, section) != "fsdp2":
            strategy = getattr(cfg, section).strategy
            p.append(f"{section}.fsdp.{offload[0]}: offload is a setting of the fsdp2 backend, and {section} trains"
                     f" on megatron ({section}.strategy={strategy}); use {section}.strategy=fsdp2")
    return p


def _lora_problems(cfg: RunConfig, mapping: DeviceMapping) -> list[str]:
    lora, p = cfg.actor.lora, []
    if lora.rank < 0:
        p.append(f"actor.lora.rank: must be 0 (no adapter: full fine-tuning) or a positive rank, got {lora.rank}")
    if lora.rank <= 0:
        return p
    if lora.sync not in SYNC_MODES:
        p.append(f"actor.lora.sync: {lora.sync!r} is not one of {', '.join(SYNC_MODES)}")
    if cfg.actor.strategy == "megatron":
        p.append("actor.lora.rank: LoRA runs on the fsdp2 backend (peft over any transformers model), and"
                 " actor.strategy=megatron; use actor.strategy=auto or fsdp2")
    if not lora.alpha > 0:
        p.append(f"actor.lora.alpha: must be positive (the update is scaled by alpha / rank), got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        p.append(f"actor.lora.dropout: must lie in [0, 1), got {lora.dropout}")
    targets = lora.target_modules
    if not (targets == "all-linear" or isinstance(targets, list) and targets
            and all(isinstance(t, str) and t for t in targets)):
        p.append(f"actor.lora.target_modules: \"all-linear\" or a list of module names (\"q_proj\", ...),"
                 f" got {targets!r}")
    if lora.sync == "adapter":
        if cfg.rollout.backend != "vllm":
            p.append(f"actor.lora.sync=adapter: needs rollout.backend=vllm (its LoRA support), got"
                     f" {cfg.rollout.backend!r}; actor.lora.sync=merged sends the merged weights to any backend")
        if lora.rank > MAX_VLLM_LORA_RANK:
            p.append(f"actor.lora.rank: vLLM serves adapters up to rank {MAX_VLLM_LORA_RANK}, got {lora.rank};"
                     f" use actor.lora.sync=merged for a larger rank")
    ref, actor = mapping.roles.get("ref"), mapping.roles.get("actor")
    if ref is not None and actor is not None and (ref.colocate is None or ref.colocate != actor.colocate):
        p.append("mapping.roles.ref: with actor.lora the reference is the actor's base model with the adapter off,"
                 " so it runs in the actor's processes: give ref the actor's colocate name (it then needs no"
                 " devices or weights of its own)")
    return p
