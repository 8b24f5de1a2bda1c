"""``hybridlab explain``: the sizes a config implies, the mapping drawn in text, and memory per worker.

    hybridlab explain [CONFIG] [key=value ...]

prints prompts and samples per step, optimizer steps and mini-batches per update, sequences and
micro-batches per data-parallel rank, tokens per step, and an estimate of the resident memory of
every worker process. Inconsistent sizes are refused with the arithmetic that fails (the same
checks a run makes). The memory estimate is a runtime base calibrated on real runs on our
machines plus what the model and the layout add (weights, gradients, AdamW moments, logits, KV
cache; activations are not counted); see ``MEMORY`` for where each constant comes from.
``tests/test_dashboard.py`` holds the whole estimate within a factor of 1.5 of a real tiny
run's resident memory, ``tests/test_explain.py`` the model terms on the mid preset.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from hybridlab.backend_checks import training_strategy
from hybridlab.config import RunConfig
from hybridlab.controller.mapping import DeviceMapping, rank_label
from hybridlab.controller.mapping_drawing import labels_text
from hybridlab.dataflow.defaults import dataflow_names, default_mapping
from hybridlab.dataflow.pairs import load_pairs, pair_ids
from hybridlab.dataflow.prompts import load_samples
from hybridlab.models.chat import prompt_ids, use_template
from hybridlab.models.spec import ModelSpec
from hybridlab.models.zoo import resolve_model
from hybridlab.reshard.plan import hf_shapes

# Where each constant comes from.
# - The runtime bases (``*_mb``): resident memory of a worker process beyond what the model adds:
#   every worker process (Python, torch, Ray's worker), plus what each kind of role loads once per
#   process: Megatron-core with gloo (actor, critic, ref), a vLLM engine, a reward scorer. They
#   are round numbers calibrated, by hand and by no script in the repository, against the
#   resident memory (``rss_mb``) in the device samples (``telemetry.jsonl``) of the worker
#   processes of real runs on our CPU machines (AMD EPYC; float32). They were not measured one by
#   one and no command separates them. process_mb + vllm_mb = 650 MB is the fixed cost of a vLLM
#   engine process measured when the stack was set up (docs/install.md). The command that
#   measures their sum again, on a real tiny run with every role in one process, is
#   ``pytest tests/test_dashboard.py -k memory_estimate`` (held within a factor of 1.5).
# - The per-parameter bytes are arithmetic, not measurements: fp32 is 4 bytes; a trainer keeps
#   weights, gradients and two AdamW moments (16), a frozen copy weights only (4). The command
#   ``python tests/test_explain.py [PRESET [ROWS SEQ]]`` measures the resident memory they stand
#   for (a transformers model of a zoo preset, default mid, stepped with AdamW on ROWS x SEQ
#   tokens, default 2 x 32) and prints it beside the estimate; the test holds it within 0.85-1.2.
# - logit_copies is a count of tensors (logits, their log-softmax and its gradient), not measured.
# Activations saved for the backward pass are not counted, so the estimate is of the memory held
# between steps with small micro-batches. On mid, 8 x 40 tokens leave about 60 MB more resident
# than 2 x 32 (the command above), and ``hybridlab bench train --json``'s peak RSS of an actor
# worker (8 x 128-token micro-batches; docs/benchmarks.md: 1.07 GB small, 1.79 GB mid) is 1.8 to 2.1 times
# this estimate of that process.
MEMORY = {"process_mb": 350.0, "megatron_mb": 150.0, "vllm_mb": 300.0, "reward_mb": 30.0,
          "train_bytes_per_param": 16.0,   # fp32 weights + gradients + two AdamW moments
          "frozen_bytes_per_param": 4.0,   # ref model, rollout engine: fp32 weights only
          "logit_copies": 3.0}             # logits, log-softmax and their gradient, per micro-batch
RUNTIME = {"actor": "megatron_mb", "critic": "megatron_mb", "ref": "megatron_mb", "rollout": "vllm_mb",
           "reward": "reward_mb"}
TRAINERS = ("actor", "critic")
BACKEND_ROLES = ("actor", "critic", "ref")  # run by a training backend (the ref by the actor's)


@dataclasses.dataclass
class Explanation:
    """What a config implies: ``sizes`` (name -> number), ``lines`` (the printed text),
    ``memory_mb`` (process set -> estimated resident MB per process)."""

    sizes: dict
    lines: list[str]
    memory_mb: dict

    def text(self) -> str:
        """Return the explanation as plain text."""
        return "\n".join(self.lines)

    def markdown(self) -> str:
        """Return the explanation as Markdown (a fenced block, for the dashboard)."""
        return "```\n" + self.text() + "\n```"


def parameter_count(model_dir: str | Path) -> int:
    """Return the number of parameters in a checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


def _micro_rows(section, seq_len: int) -> int:
    """Rows of the longest length one micro-batch holds: a token budget holds at least this
    many (more when packed), else micro_batch_size."""
    return max(1, section.micro_batch_tokens // max(1, seq_len)) if section.micro_batch_tokens else section.micro_batch_size


def _update_sizes(cfg: RunConfig, role: str, dp: int, seq_len: int) -> dict:
    section = getattr(cfg, role)
    prompts, n = cfg.data.prompts_per_step, cfg.rollout.n
    mini_rows = section.ppo_mini_batch_size * n
    per_rank = mini_rows // dp
    rows = _micro_rows(section, seq_len)
    return {"mini_batches": prompts // section.ppo_mini_batch_size,
            "optimizer_steps": prompts // section.ppo_mini_batch_size * section.ppo_epochs,
            "sequences_per_mini_batch": mini_rows, "sequences_per_rank": per_rank,
            "micro_batches_per_rank": math.ceil(per_rank / rows), "micro_rows": min(per_rank, rows)}


def expert_parameter_count(spec: ModelSpec) -> int:
    """Return how many of a model's parameters are routed experts' (0 for a dense model)."""
    return sum(math.prod(shape) for name, shape in hf_shapes(spec).items() if ".mlp.experts." in name)


def estimate_memory(cfg: RunConfig, mapping: DeviceMapping, params: int, vocab: int, seq_len: int,
                    experts: int = 0) -> dict:
    """Return process set (its roles joined by '+') -> estimated resident MB of each of its
    processes, from ``MEMORY``, the model's size (``experts`` of its ``params`` are routed
    experts, split further over a role's ``ep``) and the layout (reward models: not counted)."""
    m, out = MEMORY, {}
    for _, members in mapping.process_sets():
        mb = m["process_mb"] + sum(m[kind] for kind in {RUNTIME.get(r, "reward_mb") for r in members})
        for role in members:
            lay = mapping.roles[role]
            section = "critic" if role == "critic" else "actor"
            # FSDP2 shards weights, gradients and moments over the DP ranks (plus one layer
            # gathered at a time, not counted); Megatron over TP x PP
            fsdp = role in BACKEND_ROLES and training_strategy(cfg, section) == "fsdp2"
            shard = params / lay.dp if fsdp else (params - experts + experts / lay.ep) / (lay.tp * lay.pp)
            # LoRA: the actor's base is frozen (its adapter, a few % of it, is not counted) and the
            # reference is that same base model
            lora = section == "actor" and cfg.actor.lora.rank > 0
            if role in TRAINERS:
                sizes = _update_sizes(cfg, role, lay.dp, seq_len)
                logits = sizes["micro_rows"] * seq_len * (vocab / lay.tp) * 4 * m["logit_copies"]
                per_param = m["frozen_bytes_per_param" if lora else "train_bytes_per_param"]
                mb += (shard * per_param + logits) / 2**20
            elif role == "ref":
                rows = min(_micro_rows(cfg.actor, seq_len), cfg.data.prompts_per_step * cfg.rollout.n)
                logits = rows * seq_len * vocab * 4
                mb += ((0 if lora else shard * m["frozen_bytes_per_param"]) + logits) / 2**20
            elif role == "rollout":
                mb += params / lay.tp * m["frozen_bytes_per_param"] / 2**20 + cfg.rollout.kv_cache_mb
        out["+".join(members)] = round(mb, 1)  # colocated roles share the process and its runtimes
    return out


def draw_mapping(mapping: DeviceMapping) -> list[str]:
    """Return the mapping as text lines: each pool, each of its devices, the role ranks on it."""
    lines, first = [], 0
    for name, pool in mapping.pools.items():
        nodes = f", on nodes labelled {labels_text(pool.node_labels)}" if pool.node_labels else ""
        lines.append(f"pool {name} ({pool.devices} device{'s' if pool.devices > 1 else ''}{nodes}):")
        for d in range(pool.devices):
            ranks = [rank_label(r, lay, d) for r, lay in mapping.roles.items() if lay.pool == name and d < lay.world_size]
            lines.append(f"  device {first + d}: {', '.join(ranks) or '(idle)'}")
        first += pool.devices
    return lines


def _step_shape(cfg: RunConfig, tokenizer) -> tuple[list[int], int, int, str]:
    """Return the training prompts' token lengths (the first 2,000), the sequences per prompt, the
    most tokens after a prompt, and what a step takes, in words."""
    prompts = cfg.data.prompts_per_step
    if cfg.data.preferences:  # offline DPO: the pairs' prompts and their longer response
        ids = [pair_ids(tokenizer, pair) for pair in load_pairs(cfg)[:2000]]
        return ([len(p) for p, _, _ in ids], 2, max(max(len(c), len(r)) for _, c, r in ids),
                f"{prompts} preference pairs (data.prompts_per_step) x 2 (chosen, rejected)")
    lengths = [len(prompt_ids(tokenizer, s)) for s in load_samples(cfg, "train")[:2000]]
    return (lengths, cfg.rollout.n, cfg.rollout.max_new_tokens,
            f"{prompts} prompts (data.prompts_per_step) x {cfg.rollout.n} samples (rollout.n)")


def _dpo_update_line(cfg: RunConfig) -> str:
    """Return the line that says what the actor's DPO update (offline or online) does per step."""
    prompts = cfg.data.prompts_per_step
    which = (f"offline DPO, the step's {prompts} pairs" if cfg.data.preferences else
             f"online DPO, one pair per prompt whose samples score differently (at most {prompts})")
    return (f"actor update ({training_strategy(cfg, 'actor')} backend): {which}, {cfg.actor.ppo_epochs}"
            f" optimizer step(s) on all of them per step; dpo.loss_type {cfg.dpo.loss_type}, beta {cfg.dpo.beta:g}")


def explain(cfg: RunConfig, model_dir: str | Path | None = None) -> Explanation:
    """Return the Explanation of a validated ``cfg`` (``load_config``'s, or a session's, which
    refuse sizes that do not fit); ``model_dir`` defaults to the config's model."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir or resolve_model(cfg.model, data=cfg.data))
    spec = ModelSpec.read(model_dir)
    params = parameter_count(model_dir)
    names = dataflow_names(cfg)
    mapping = DeviceMapping.from_dict(cfg.mapping or default_mapping(cfg, names))
    tokenizer = use_template(AutoTokenizer.from_pretrained(model_dir), cfg.data.chat_template)
    prompts = cfg.data.prompts_per_step
    prompt_lens, n, new, what = _step_shape(cfg, tokenizer)
    mean_prompt, max_prompt = sum(prompt_lens) / len(prompt_lens), max(prompt_lens)
    samples = prompts * n
    seq_len = max_prompt + new
    sizes = {"prompts_per_step": prompts, "samples_per_step": samples, "parameters": params,
             "prompt_tokens_mean": round(mean_prompt, 1), "prompt_tokens_max": max_prompt,
             "tokens_per_step_max": samples * (max_prompt + new),
             "tokens_per_step_mean_prompt": round(samples * (mean_prompt + new))}
    lines = [f"model {model_dir.name}: {params / 1e6:.2f}M parameters, vocabulary {spec.vocab_size},"
             f" {spec.layers} layers, hidden {spec.hidden}",
             f"per step: {what} = {samples} sequences",
             f"tokens per step: {samples} x (prompt {mean_prompt:.1f} mean / {max_prompt} max + up to {new} new)"
             f" = about {sizes['tokens_per_step_mean_prompt']}, at most {sizes['tokens_per_step_max']}"]
    for role in TRAINERS:
        if role not in mapping.roles or (role == "critic" and "update_critic" not in names):
            continue
        lay, section = mapping.roles[role], getattr(cfg, role)
        u = _update_sizes(cfg, role, lay.dp, seq_len)
        sizes[role] = u
        by_tokens = section.micro_batch_tokens and lay.ep == 1  # expert parallelism: padded rows (engine)
        cut = (f"at most {u['micro_batches_per_rank']} micro-batch(es) of at most {section.micro_batch_tokens} tokens"
               f" ({role}.micro_batch_tokens{', packed' if section.remove_padding else ''})"
               if by_tokens else
               f"{math.ceil(u['sequences_per_rank'] / section.micro_batch_size)} micro-batch(es) of at most"
               f" {section.micro_batch_size} ({role}.micro_batch_size{', padded: ep > 1' if lay.ep > 1 else ''})")
        if role == "actor" and "update_actor_dpo" in names:
            lines.append(_dpo_update_line(cfg))
            continue
        lines.append(f"{role} update ({training_strategy(cfg, role)} backend): {prompts} prompts"
                     f" / {section.ppo_mini_batch_size} ({role}.ppo_mini_batch_size)"
                     f" = {u['mini_batches']} mini-batches x {section.ppo_epochs} epoch(s) = {u['optimizer_steps']}"
                     f" optimizer steps; each {section.ppo_mini_batch_size} x {n} = {u['sequences_per_mini_batch']}"
                     f" sequences / dp {lay.dp} = {u['sequences_per_rank']} per rank in {cut}")
    lora = cfg.actor.lora
    if lora.rank > 0:
        lines.append(f"actor LoRA: rank {lora.rank}, alpha {lora.alpha:g}, on {lora.target_modules}; only the adapter"
                     f" trains and syncs ({'the adapter alone' if lora.sync == 'adapter' else 'merged into the base'})"
                     + ("; ref is the actor's base model with the adapter off, in the actor's processes"
                        if "ref" in mapping.roles else ""))
    lines += _pipeline_lines(cfg, samples)
    lines += ["device mapping:", *draw_mapping(mapping)]
    memory = estimate_memory(cfg, mapping, params, spec.vocab_size, seq_len, expert_parameter_count(spec))
    lines.append("estimated resident memory per process (runtime base + model state, activations not"
                 " counted; see hybridlab.explain.MEMORY):")
    lines += [f"  {name}: {mb:.0f} MB" for name, mb in memory.items()]
    return Explanation(sizes, lines, memory)


def _pipeline_lines(cfg: RunConfig, samples: int) -> list[str]:
    """Return how generation overlaps training: streaming, off-policy batches ahead, or none."""
    t, prompts = cfg.trainer, cfg.data.prompts_per_step
    if t.streaming:
        return [f"streaming rollouts: the rollout engines generate continuously; a step trains the first {prompts}"
                f" groups to finish ({samples} samples); prompts are admitted while at most (steps done +"
                f" {t.max_staleness} + 1) x {prompts} have been (trainer.max_staleness={t.max_staleness}), so the"
                f" oldest token of a trained sample is at most {t.max_staleness} update(s) old unless it outlasts"
                f" later prompts (then trainer.stale_samples={t.stale_samples}); a sync does not wait for samples in"
                f" flight, which go on from their {'old KV cache' if t.partial_rollouts == 'keep' else 'KV cache computed again'}"
                f" (trainer.partial_rollouts={t.partial_rollouts})"]
    if t.off_policy:
        return [f"off-policy: the rollouts of the next {t.max_staleness} step(s) are submitted ahead, so generation"
                f" overlaps training; each batch is at most {t.max_staleness} update(s) stale"]
    return []

