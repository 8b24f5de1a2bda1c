"""``hybridlab serve tinker``: serve the Tinker training API on this machine's workers.

Tinker code runs against it unchanged: set ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` to what
the command prints (docs/tinker.md).
"""
from __future__ import annotations

import threading

SERVICES = ("tinker",)


def cmd_serve(args) -> int:
    """Serve until interrupted; returns the exit status."""
    from hybridlab.tinker.server import TinkerServer
    from hybridlab.tinker.settings import load_settings

    settings = load_settings(args.config, args.overrides)  # every setting checked before a worker starts
    if args.explain:
        from hybridlab.tinker.service import TinkerService

        print(TinkerService(settings).explain(), flush=True)
        return 0
    print(f"starting the Tinker API on {settings.model} ...", flush=True)
    server = TinkerServer(settings).start()
    print(f"serving {server.service.base_model} ({server.service.model_dir}); its dashboard:"
          f" hybridlab dashboard {server.service.dashboard_dir}\n"
          f"TINKER_BASE_URL={server.base_url}\nTINKER_API_KEY={server.api_key}", flush=True)
    try:
        threading.Event().wait()
    finally:
        server.stop()
    return 0


def add_command(sub) -> None:
    """Add ``serve`` to the ``hybridlab`` command's subparsers."""
    s = sub.add_parser("serve", help="serve an API on this machine's workers: tinker (the Tinker training API)")
    s.add_argument("service", choices=SERVICES, help="what to serve")
    s.add_argument("config", nargs="?", default=None, help="YAML file of the service's settings (omit for defaults)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings, e.g. model=small port=8700")
    s.add_argument("--explain", action="store_true", help="print what would run where, and start nothing")
    s.set_defaults(func=cmd_serve)
