"""One gloo transport device per worker process, shared by all its gloo process groups.

torch.distributed gives every gloo process group a transport device of its own, and each device
runs an event-loop thread that wakes every 10 ms (gloo's ``tcp::Loop`` polls with that
timeout). Megatron cuts about 30 groups from a one-rank world (tensor, pipeline, data, context,
expert, embedding... parallel groups, and its gloo copies of the data-parallel ones), vLLM a
few more, so an idle training process spent about 5% of a core on 33 polling threads (1.0 s in
20 s, measured on our 2-core machines), all its life, and every worker process of a node pays it.

Groups built after ``share_one_gloo_device()`` take the process's one device: one loop thread,
whatever the number of groups. gloo runs any number of groups on one device (its pairs connect
through the device's one listener, each under a sequence number of its own); the public
``ProcessGroupGloo`` constructor taking options with ``_devices`` is the way torch offers it.
torch.distributed's ``new_group`` builds gloo groups with a fresh default device and no way to
pass one, so the class it calls is replaced, in ``distributed_c10d`` alone, by a subclass that
passes the shared device. nccl groups are untouched; on GPU nodes this serves Megatron's gloo
groups (only the CPU path has run on our machines).
"""
from __future__ import annotations

import datetime

import torch.distributed.distributed_c10d as c10d

_GLOO = c10d.ProcessGroupGloo  # torch's own class, before any replacement
_DEVICE: list = []  # the process's one device, made on first use (it reads GLOO_SOCKET_IFNAME then)


class SharedDeviceGloo(_GLOO):
    """``ProcessGroupGloo`` on the process's shared transport device, with torch's defaults."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta = datetime.timedelta(minutes=30)):
        if not _DEVICE:
            _DEVICE.append(_GLOO.create_default_device())
        options = _GLOO._Options()
        options._devices, options._timeout = _DEVICE, timeout
        super().__init__(store, rank, size, options)


def share_one_gloo_device() -> None:
    """Make the gloo process groups built from now on in this process share one device."""
    c10d.ProcessGroupGloo = SharedDeviceGloo
