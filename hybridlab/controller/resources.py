"""Ray connection and resource pools: placement groups of device bundles.

On a machine without GPUs the cluster declares *logical* GPUs, so one device mapping runs
unchanged here and on a GPU cluster: Ray assigns device ids and ``CUDA_VISIBLE_DEVICES`` the
same way, and the engines pick gloo/CPU or nccl/CUDA by what torch sees.
"""
from __future__ import annotations

import dataclasses
import os
import uuid

import ray

from hybridlab.controller.mapping import STRATEGIES
from hybridlab.errors import UserError


def connect(address: str | None = None, num_gpus: int | None = None, num_cpus: int | None = None,
            temp_dir: str | None = None, min_gpus: int = 0) -> dict:
    """Connect to Ray and return the cluster's total resources.

    ``address=None`` attaches to the cluster that ``RAY_ADDRESS`` names, as any Ray program
    does, and without it starts a local cluster in this process with ``num_gpus`` logical GPUs
    (default: the real GPUs, else max(4, ``min_gpus``) logical ones, so a session can remap onto
    more devices than it started with); ``"auto"`` or ``"ray://..."`` attaches to an existing
    one. An already connected process keeps its connection.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    if not ray.is_initialized():
        env = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                            "RAY_DEDUP_LOGS": "0",
                            # vLLM's per-engine INFO lines drown the notebook; warnings still show, on
                            # standard error (vLLM's default is standard output, which `--json` keeps for data)
                            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                            "VLLM_LOGGING_STREAM": os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stderr")}}
        if address:
            ray.init(address=address, runtime_env=env, log_to_driver=True)
        else:
            real = _cuda_device_count()
            ray.init(num_gpus=num_gpus if num_gpus is not None else (real or max(4, min_gpus)),
                     num_cpus=num_cpus if num_cpus is not None else max(8, os.cpu_count() or 1),
                     include_dashboard=False, _temp_dir=temp_dir or _short_temp_dir(),
                     runtime_env=env, log_to_driver=True, configure_logging=False,
                     # no idle workers started ahead: every worker of ours sets its own
                     # environment, so Ray starts a process of its own for it anyway (each idle
                     # one cost about 0.5 s of CPU at every cluster start)
                     _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
    return ray.cluster_resources()


def _short_temp_dir() -> str:
    # Ray puts unix sockets under its temp dir; their paths must stay under ~107 characters,
    # so use a short, stable folder (Ray adds one session_* folder per cluster inside it).
    path = os.path.join("/tmp", f"hlray-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def node_summary() -> str:
    """Return each alive Ray node's GPUs and labels, for error messages."""
    parts = []
    for node in ray.nodes():
        if node.get("Alive"):
            labels = {k: v for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")}
            parts.append(f"{node['NodeManagerAddress']} ({node['Resources'].get('GPU', 0):g} GPUs, labels {labels})")
    return "; ".join(parts) or "none"


@dataclasses.dataclass
class ResourcePool:
    """``devices`` device bundles placed with ``strategy``; each bundle is one GPU (or logical GPU)
    plus ``cpus_per_device`` CPUs, on nodes carrying ``node_labels`` when given. ``create()``
    reserves them as a Ray placement group (its bundle label selector pins them to the nodes)."""

    name: str
    devices: int
    strategy: str = "PACK"
    cpus_per_device: float = 1.0
    node_labels: dict | None = None
    pg: object = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UserError(f"pool {self.name!r}: unknown strategy {self.strategy!r}; choose one of:"
                            f" {', '.join(STRATEGIES)}")
        if not isinstance(self.devices, int) or self.devices < 1:
            raise UserError(f"pool {self.name!r}: devices must be a positive integer, got {self.devices!r}")

    def create(self, timeout: float = 60.0) -> "ResourcePool":
        """Reserve the bundles (once); returns self. Raises UserError if the cluster lacks devices."""
        from ray.util.placement_group import placement_group

        if self.pg is not None:
            return self
        total = ray.cluster_resources().get("GPU", 0)
        if total < self.devices:
            raise UserError(f"pool {self.name!r} needs {self.devices} devices but the cluster has {total:g} GPUs")
        labelled = [n for n in ray.nodes() if n.get("Alive") and self.node_labels and all(
            (n.get("Labels") or {}).get(k) == v for k, v in self.node_labels.items())]
        if self.node_labels and not labelled:  # Ray would wait for such a node forever
            raise UserError(f"pool {self.name!r}: no node carries the labels {self.node_labels}"
                            f" (pools.{self.name}.node_labels); nodes: {node_summary()}")
        bundles = [{"GPU": 1, "CPU": self.cpus_per_device} for _ in range(self.devices)]
        # Unique per reservation: two sessions (or a pool re-created by a remap) may share a name.
        selector = [dict(self.node_labels)] * self.devices if self.node_labels else None
        pg = placement_group(bundles, strategy=self.strategy, name=f"hybridlab-{self.name}-{uuid.uuid4().hex[:8]}",
                             bundle_label_selector=selector)
        try:
            ray.get(pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            where = f" on nodes labelled {self.node_labels}" if self.node_labels else ""
            raise UserError(f"pool {self.name!r}: {self.devices} bundles with strategy {self.strategy}{where} could"
                            f" not be placed within {timeout:.0f} s (not enough free devices on those nodes? nodes:"
                            f" {node_summary()})") from None
        self.pg = pg
        return self

    def bundles(self) -> list[tuple[object, int]]:
        """Return (placement group, bundle index) for every device of the pool."""
        self.create()
        return [(self.pg, i) for i in range(self.devices)]

    def bundle_nodes(self) -> list[str]:
        """Return the node id of every bundle, in bundle order."""
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.create().pg)
        return [table["bundles_to_node_id"][i] for i in range(self.devices)]

    def remove(self) -> None:
        """Release the bundles (the processes placed on them must be gone first)."""
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
