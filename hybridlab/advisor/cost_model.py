"""The cost model: a step's time per stage, the whole step, device-busy fraction and memory,
predicted for a config and a device mapping on a DeviceProfile.

    work = Workload.of(cfg)                      # the model's size and the tokens of a step
    p = predict(work, cfg, mapping, profile)     # Prediction: stage_s, step_s, busy, memory_mb

Each dataflow stage costs what its role's engine does per device (``advisor/profile.py`` gives
the formulas), divided over the role's data-parallel ranks and tensor/pipeline shards:

- ``generate``: per engine (``dp`` of them), a prefill of its prompts and ``response_max`` decode
  steps whose batch shrinks as responses end (``response_mean`` tokens per sequence);
  TP adds two all-reduces of the batch's hidden states per layer and step, over the engine's
  own communicator (``engine_collective_latency_s``; vLLM on a CPU node uses shared memory).
- forward passes (``old_logprob``, ``ref_logprob``, ``values``, ``reward_model``): the step's
  tokens over ``dp``, the model over ``tp x pp``; PP adds the pipeline bubble
  ``(m + pp - 1) / m`` for ``m`` micro-batches and each micro-batch's activations sent across
  the ``pp - 1`` stage boundaries (both ways when training).
- updates: the same as training tokens, ``ppo_epochs`` times, plus a gradient all-reduce over
  ``dp`` per optimizer step.
- MoE models compute with their active experts (``top_k`` of ``experts``; Megatron does not split
  them over TP ranks here), and their sparse layers add the allgather token dispatcher's
  collectives over each training role's ``tp x ep`` group; with ``ep`` the micro-batches are
  padded (the engine's) and the experts' gradients are all-reduced over ``dp / ep`` ranks.
- ``sync_weights``: the weights copied in memory when the rollout shares the actor's processes,
  else sent over the collective backend.
- every stage that calls workers pays ``call_overhead_s``; controller stages cost nothing.

Stages run one after another. With ``trainer.off_policy`` the next step's generation runs during
this step's other stages, but only when the rollout's devices are not the trainers' and no other
stage runs in the rollout's processes (a reward there waits behind the next generation): the
step is then the longer of the two sides. A ``trainer.max_staleness`` above 1 gives the same
steady state: every step costs the mean times here, and a deeper queue only evens out steps
whose generation and training times vary. With ``trainer.streaming`` (rollout devices of its
own) the engines run all the time at a full batch: a step's generation costs the decode steps
of the mean response, not of the longest (no drain: unfinished samples go on into the next
step), it overlaps every other stage (the reward included: it runs on the taken groups), and
the sync, which pauses the engines, adds to both sides: the step is the longer side plus the
sync. Busy fraction: the device-seconds the stages keep busy over
``step_s x devices``. Memory per device comes from ``explain.estimate_memory``.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from hybridlab.advisor.profile import DeviceProfile
from hybridlab.config import RunConfig
from hybridlab.controller.mapping import DeviceMapping, RoleLayout
from hybridlab.dataflow.defaults import dataflow_names
from hybridlab.dataflow.stages import STAGES
from hybridlab.explain import estimate_memory, expert_parameter_count, explain
from hybridlab.models.spec import ModelSpec
from hybridlab.models.zoo import resolve_model

FORWARD_STAGES = {"old_logprob": "actor", "ref_logprob": "ref", "values": "critic", "reward_model": "reward"}
UPDATE_STAGES = {"update_actor": "actor", "update_actor_dpo": "actor", "update_critic": "critic"}
GENERATE_STAGES = ("generate", "generate_agent")
WORKER_STAGES = ("reward", "remax_baseline")  # cheap worker calls: the overhead only
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass
class Workload:
    """What one step computes: the model's dimensions and the step's sequences and tokens."""

    params: int
    layers: int
    hidden: int
    vocab: int
    samples: int                 # sequences per step
    prompt_mean: float
    prompt_max: int
    response_mean: float         # generated tokens per sequence, on average
    response_max: int            # decode steps of a generation
    expert_params: int = 0       # of ``params``, the routed experts' (MoE; 0 for a dense model)
    experts: int = 0             # routed experts per sparse layer, of which each token uses ``top_k``
    top_k: int = 0
    moe_layers: int = 0          # the layers with routed experts

    @property
    def active_expert_params(self) -> float:
        """Return the routed experts' parameters one token computes with: ``top_k`` of the
        ``experts`` (0 for a dense model)."""
        return self.expert_params * self.top_k / self.experts if self.experts else 0.0

    @property
    def active_params(self) -> float:
        """Return the parameters one token computes with: the dense ones and its active experts'."""
        return self.params - self.expert_params + self.active_expert_params

    def train_params(self, tp: int) -> float:
        """Return the parameters one token computes with on one of ``tp`` Megatron ranks: the
        dense ones split over them, the active experts not (every TP rank routes the whole
        sequence, so an expert shard sees the tokens of all ``tp`` ranks: ``workers/train/moe.py``)."""
        return (self.params - self.expert_params) / tp + self.active_expert_params

    def read_params(self, tokens: float) -> float:
        """Return the parameters a pass over ``tokens`` at once reads from memory: every dense
        one, and the experts that many tokens reach, expected under even routing."""
        if not self.experts:
            return float(self.params)
        reached = 1.0 - (1.0 - self.top_k / self.experts) ** tokens
        return self.params - self.expert_params + self.expert_params * reached

    @classmethod
    def of(cls, cfg: RunConfig, model_dir: str | Path | None = None,
           response_mean: float | None = None) -> "Workload":
        """Return the workload of ``cfg`` (its model's checkpoint, its prompts' lengths); responses
        are ``rollout.max_new_tokens`` long unless ``response_mean`` (e.g. a run's measured mean) is given."""
        model_dir = Path(model_dir or resolve_model(cfg.model, data=cfg.data))
        sizes, spec = explain(cfg, model_dir).sizes, ModelSpec.read(model_dir)
        new, moe = cfg.rollout.max_new_tokens, spec.moe
        return cls(params=sizes["parameters"], layers=spec.layers, hidden=spec.hidden, vocab=spec.vocab_size,
                   samples=sizes["samples_per_step"], prompt_mean=sizes["prompt_tokens_mean"],
                   prompt_max=sizes["prompt_tokens_max"], response_mean=float(response_mean or new),
                   response_max=new, expert_params=expert_parameter_count(spec),
                   experts=moe.experts if moe else 0, top_k=moe.top_k if moe else 0,
                   moe_layers=len(moe.sparse_layers) if moe else 0)

    @property
    def tokens(self) -> float:
        """Return the tokens of the step's sequences (prompt and response), on average."""
        return self.samples * (self.prompt_mean + self.response_mean)


@dataclasses.dataclass
class Prediction:
    """A predicted step: seconds per stage, the step (with overlap), the busy fraction of the
    devices, and estimated resident MB per device (and the largest)."""

    stage_s: dict[str, float]
    step_s: float
    busy: float
    memory_mb: dict[str, float]
    overlapped: bool = False

    @property
    def peak_memory_mb(self) -> float:
        """Return the largest per-device memory estimate."""
        return max(self.memory_mb.values(), default=0.0)


def allreduce_s(profile: DeviceProfile, nbytes: float, ranks: int) -> float:
    """Return seconds for a ring all-reduce of ``nbytes`` over ``ranks`` devices (0 for one)."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * profile.collective_latency_s + 2 * (ranks - 1) / ranks * nbytes / profile.collective_gbps


def _tp_traffic_s(profile: DeviceProfile, work: Workload, tokens: float, tp: int, passes: int,
                  launches: float, engine: bool = False) -> float:
    """Return the seconds TP's all-reduces add: ``passes`` per layer (2 forward, 4 with backward)
    over ``tokens`` hidden states, in ``launches`` batches (decode steps or micro-batches); the
    rollout ``engine``'s own communicator (vLLM's: shared memory on a CPU node) where given."""
    if tp <= 1:
        return 0.0
    nbytes = tokens * work.hidden * DTYPE_BYTES[profile.dtype]
    latency, link = ((profile.engine_collective_latency_s, profile.bandwidth) if engine
                     else (profile.collective_latency_s, profile.collective_gbps))
    return passes * work.layers * (launches * (tp - 1) * latency + 2 * (tp - 1) / tp * nbytes / link)


def generate_s(profile: DeviceProfile, work: Workload, lay: RoleLayout) -> float:
    """Return the seconds of one step's generation on ``lay`` (every engine in parallel)."""
    batch = math.ceil(work.samples / lay.dp)
    shard, read = work.active_params / lay.tp, work.read_params(batch) / lay.tp  # a decode step reads its weights
    flops, nbytes = profile.flops, DTYPE_BYTES[profile.dtype]
    prefill = batch * work.prompt_mean * (profile.prefill_token_s + 2 * shard / flops)
    steps, tokens = work.response_max, batch * work.response_mean
    decode = (steps * (profile.decode_overhead_s + read * nbytes / profile.bandwidth)
              + tokens * (profile.decode_token_s + 2 * shard / flops))
    comm = _tp_traffic_s(profile, work, tokens + batch * work.prompt_mean, lay.tp, 2, steps + 1, engine=True)
    return prefill + decode + comm + profile.call_overhead_s


def _micro_batches(cfg: RunConfig, role: str, lay: RoleLayout, work: Workload) -> int:
    section = cfg.critic if role == "critic" else cfg.actor
    rows = math.ceil(work.samples / lay.dp)
    if section.micro_batch_tokens and lay.ep == 1:  # expert parallelism: padded rows (the engine's)
        return max(1, math.ceil(rows * (work.prompt_mean + work.response_mean) / section.micro_batch_tokens))
    return max(1, math.ceil(rows / section.micro_batch_size))


def forward_s(profile: DeviceProfile, cfg: RunConfig, work: Workload, role: str, lay: RoleLayout,
              train: bool = False) -> float:
    """Return the seconds of a forward pass (``train``: forward, backward and optimizer) over the
    step's tokens on ``lay``; an update repeats it ``ppo_epochs`` times and all-reduces gradients."""
    tokens = work.tokens / lay.dp
    if lay.ep > 1:  # the engine pads every micro-batch to the batch's width: one shape on the EP group
        tokens = math.ceil(work.samples / lay.dp) * (work.prompt_max + work.response_max)
    shard = work.train_params(lay.tp) / lay.pp
    micro = _micro_batches(cfg, role, lay, work)
    bubble = (micro + lay.pp - 1) / micro
    if train:
        per_token = profile.train_token_s + 6 * shard / (profile.flops * profile.train_efficiency)
    else:
        per_token = profile.forward_token_s + 2 * shard / (profile.flops * profile.forward_efficiency)
    seconds = tokens * per_token * bubble + _tp_traffic_s(profile, work, tokens / lay.pp, lay.tp, 4 if train else 2,
                                                          micro)
    # PP: each micro-batch's activations cross pp - 1 stage boundaries (and back, for the gradients)
    activations = tokens / micro * work.hidden * DTYPE_BYTES[profile.dtype]
    hop = profile.collective_latency_s + activations / profile.collective_gbps
    seconds += (lay.pp - 1) * micro * (2 if train else 1) * hop
    seconds += _expert_exchange_s(profile, work, tokens / lay.pp, lay, micro, train)
    if train:
        section = cfg.critic if role == "critic" else cfg.actor
        optimizer_steps = max(1, cfg.data.prompts_per_step // section.ppo_mini_batch_size)
        weights, experts = work.params / (lay.tp * lay.pp), work.expert_params / (lay.tp * lay.pp)
        gradients = allreduce_s(profile, weights * 4, lay.dp)  # one flat all-reduce of every gradient
        if lay.ep > 1:  # an expert's gradients are summed over the dp / ep ranks that hold it only
            gradients = (allreduce_s(profile, (weights - experts) * 4, lay.dp)
                         + allreduce_s(profile, experts / lay.ep * 4, lay.dp // lay.ep))
        seconds = section.ppo_epochs * seconds + section.ppo_epochs * optimizer_steps * gradients
    return seconds + profile.call_overhead_s


def _expert_exchange_s(profile: DeviceProfile, work: Workload, tokens: float, lay: RoleLayout, launches: float,
                       train: bool) -> float:
    """Return the seconds the engine's allgather token dispatcher adds over its tp x ep group
    (every TP rank routes the whole sequence): per sparse layer and micro-batch, a forward pass
    all-gathers the group's hidden states, router probabilities (fp32) and routing map and
    reduce-scatters the experts' outputs (in the probabilities' fp32), 4 ring collectives; a
    backward pass gathers the outputs' gradients and reduce-scatters the inputs' and the
    probabilities' (3 more; the map has none)."""
    group = lay.tp * lay.ep
    if group <= 1 or not work.moe_layers:
        return 0.0
    others = (group - 1) * tokens
    hidden, probs = others * work.hidden, others * work.experts
    forward = hidden * (DTYPE_BYTES[profile.dtype] + 4) + probs * (4 + 1)
    backward = hidden * (4 + DTYPE_BYTES[profile.dtype]) + probs * 4
    collectives, nbytes = (7, forward + backward) if train else (4, forward)
    latency = launches * collectives * (group - 1) * profile.collective_latency_s
    return work.moe_layers * (latency + nbytes / profile.collective_gbps)


def sync_s(profile: DeviceProfile, work: Workload, mapping: DeviceMapping) -> float:
    """Return the seconds of the weight sync: an in-memory copy when the rollout shares the
    actor's processes, else the weights sent over the collective backend."""
    nbytes = work.params * DTYPE_BYTES[profile.dtype]
    actor, rollout = mapping.roles.get("actor"), mapping.roles.get("rollout")
    shared = actor is not None and rollout is not None and actor.colocate and actor.colocate == rollout.colocate
    if shared:
        moved = 2 * nbytes / profile.bandwidth
    else:
        moved = nbytes / profile.collective_gbps + profile.collective_latency_s
    return moved + profile.call_overhead_s


def stage_seconds(profile: DeviceProfile, cfg: RunConfig, work: Workload, mapping: DeviceMapping) -> dict[str, float]:
    """Return the predicted seconds of each stage of ``cfg``'s dataflow on ``mapping``."""
    out = {}
    for name in dataflow_names(cfg):
        if name in GENERATE_STAGES:  # streaming: engines decode at a full batch, no drain to the longest
            decode = dataclasses.replace(work, response_max=math.ceil(work.response_mean)) if cfg.trainer.streaming \
                else work
            out[name] = generate_s(profile, decode, mapping.roles["rollout"])
        elif name in FORWARD_STAGES:
            role = FORWARD_STAGES[name]
            out[name] = forward_s(profile, cfg, work, role, mapping.roles[role])
        elif name in UPDATE_STAGES:
            role = UPDATE_STAGES[name]
            out[name] = forward_s(profile, cfg, work, role, mapping.roles[role], train=True)
        elif name == "sync_weights":
            out[name] = sync_s(profile, work, mapping)
        else:  # a cheap worker call, or the controller's own arithmetic
            out[name] = profile.call_overhead_s if STAGES[name].role else 0.0
    return out


def pool_devices(mapping: DeviceMapping) -> dict[str, range]:
    """Return each pool's global device indices (pools numbered in order, as PACK places them)."""
    first, out = 0, {}
    for name, pool in mapping.pools.items():
        out[name] = range(first, first + pool.devices)
        first += pool.devices
    return out


def _devices(mapping: DeviceMapping) -> dict[str, set[int]]:
    """Return each role's global device indices."""
    pools = pool_devices(mapping)
    return {role: set(pools[lay.pool]) for role, lay in mapping.roles.items()}


def _stage_devices(name: str, devices: dict[str, set[int]]) -> set[int]:
    stage = STAGES[name]
    roles = [r for r in (stage.role, *stage.needs) if r and r in devices]
    return set().union(*(devices[r] for r in roles)) if roles else set()


def role_busy(prediction: Prediction, mapping: DeviceMapping, roles: tuple[str, ...]) -> float:
    """Return the predicted busy fraction of the devices of ``roles`` (their mean): the seconds of
    the stages on each device over the step."""
    devices = _devices(mapping)
    mine = set().union(*(devices[r] for r in roles if r in devices))
    if not mine or not prediction.step_s:
        return 0.0
    busy = {d: 0.0 for d in mine}
    for name, seconds in prediction.stage_s.items():
        for d in _stage_devices(name, devices) & mine:
            busy[d] += seconds
    return sum(min(1.0, b / prediction.step_s) for b in busy.values()) / len(mine)


def memory_per_device(cfg: RunConfig, work: Workload, mapping: DeviceMapping) -> dict[str, float]:
    """Return estimated resident MB per device ("pool/index"): the sum of the process sets on it."""
    cfg = dataclasses.replace(cfg, mapping=mapping.to_dict())
    per_set = estimate_memory(cfg, mapping, work.params, work.vocab, work.prompt_max + work.response_max,
                              work.expert_params)
    out: dict[str, float] = {}
    for pool, members in mapping.process_sets():
        for d in range(mapping.pools[pool].devices):
            key = f"{pool}/{d}"
            out[key] = round(out.get(key, 0.0) + per_set["+".join(members)], 1)
    return out


def _behind_rollout(stage_s: dict[str, float], mapping: DeviceMapping) -> bool:
    """Return True when a stage other than generation and the sync runs in the rollout's
    processes: under off-policy it waits behind the next step's generation, so nothing overlaps."""
    rollout = next((members for _, members in mapping.process_sets() if "rollout" in members), ())
    return any(STAGES[n].role in rollout for n in stage_s if n not in GENERATE_STAGES and n != "sync_weights")


def predict(work: Workload, cfg: RunConfig, mapping: DeviceMapping, profile: DeviceProfile) -> Prediction:
    """Return the Prediction of one step of ``work`` under ``cfg`` on ``mapping``."""
    stage_s = stage_seconds(profile, cfg, work, mapping)
    devices = _devices(mapping)
    total = sum(p.devices for p in mapping.pools.values())
    step_s, overlapped = sum(stage_s.values()), False
    rollout_devices = devices.get("rollout", set())
    trainer_devices = set().union(*(devices[r] for r in ("actor", "critic", "ref") if r in devices))
    split = not rollout_devices & trainer_devices
    if cfg.trainer.streaming and split:  # generation overlaps every stage but the sync, which pauses it
        gen, sync = (sum(s for n, s in stage_s.items() if n in names) for names in (GENERATE_STAGES, ("sync_weights",)))
        step_s, overlapped = max(gen, step_s - gen - sync) + sync, True
    elif cfg.trainer.off_policy and split and not _behind_rollout(stage_s, mapping):
        ahead = sum(s for n, s in stage_s.items() if n in GENERATE_STAGES)
        step_s, overlapped = max(ahead, step_s - ahead), True
    busy = sum(s * len(_stage_devices(n, devices)) for n, s in stage_s.items()) / (step_s * total) if step_s else 0.0
    return Prediction({n: round(s, 6) for n, s in stage_s.items()}, round(step_s, 6), round(min(1.0, busy), 3),
                      memory_per_device(cfg, work, mapping), overlapped)
