"""A worker process's gloo transport devices, shared by all its gloo process groups.

torch.distributed gives every gloo process group a transport device of its own, and each device
runs an event-loop thread that wakes every 10 ms (gloo's ``tcp::Loop`` polls with that
timeout). Megatron cuts about 30 groups from a one-rank world (tensor, pipeline, data, context,
expert, embedding... parallel groups, and its gloo copies of the data-parallel ones), vLLM a
few more, so an idle training process spent about 5% of a core on 33 polling threads (1.0 s in
20 s, measured on our 2-core machines), all its life, and every worker process of a node pays it.

Groups built after ``share_one_gloo_device()`` take the process's devices: one loop thread per
device, whatever the number of groups. gloo runs any number of groups on one device (torch's own
note: contexts may share a device and its I/O thread), and ``ProcessGroupGloo``'s constructor
that takes options with ``_devices`` is how torch lets a group be given its devices. The devices
are the ones torch's default options would make: one per interface named in
``GLOO_SOCKET_IFNAME`` (comma-separated; ``environment.use_loopback`` names ``lo``), else the
default device (the host name's address, else loopback). torch.distributed's ``new_group`` builds
gloo groups with fresh default options and no way to pass devices, so the class it calls is
replaced, in ``distributed_c10d`` alone, by a subclass that passes the shared ones; ``isinstance``
against it holds for every gloo group, as torch's own checks there expect (setting a group's
timeout, for one). nccl groups are untouched; on GPU nodes this serves Megatron's gloo groups
(only the CPU path has run on our machines).
"""
from __future__ import annotations

import datetime
import os

import torch.distributed.distributed_c10d as c10d

_GLOO = c10d.ProcessGroupGloo  # torch's own class, before any replacement
_DEVICES: list = []  # the process's devices, made on first use (GLOO_SOCKET_IFNAME is read then)


def _make_devices() -> list:
    """Return the devices torch's default gloo options would make here."""
    names = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if names:
        return [_GLOO.create_device(interface=name) for name in names.split(",")]
    return [_GLOO.create_default_device()]


class _GlooClass(type(_GLOO)):
    """The replacement's metaclass: any gloo group, made by it or by torch, is an instance."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _GLOO)


class SharedDeviceGloo(_GLOO, metaclass=_GlooClass):
    """``ProcessGroupGloo`` on the process's shared transport devices, with torch's defaults
    (two threads per device); given options (``ProcessGroupGloo(store, rank, size, options)``)
    it uses them as they are."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta = datetime.timedelta(minutes=30)):
        if isinstance(timeout, _GLOO._Options):
            super().__init__(store, rank, size, timeout)
            return
        if not _DEVICES:
            _DEVICES.extend(_make_devices())
        options = _GLOO._Options()
        options._devices, options._timeout, options._threads = _DEVICES, timeout, 2 * len(_DEVICES)
        super().__init__(store, rank, size, options)


def share_one_gloo_device() -> None:
    """Make the gloo process groups built from now on in this process share its devices."""
    c10d.ProcessGroupGloo = SharedDeviceGloo
