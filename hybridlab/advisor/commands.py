"""The advisor's commands: ``hybridlab calibrate`` and ``hybridlab plan``."""
from __future__ import annotations

import argparse
import json
import sys


def cmd_calibrate(args) -> int:
    """Measure this machine and save its profile; returns the exit status."""
    from hybridlab.advisor.calibrate import calibrate
    from hybridlab.environment import stdout_to_stderr, use_loopback

    use_loopback()  # the all-reduce and the worker call stay on loopback
    options = {"devices": args.devices, "engine_model": args.engine_model,
               "train_models": tuple(m for m in args.train_models.split(",") if m)}
    if args.quick:
        options.update(batches=(1, 4), new_tokens=8, train_rows=2, train_seq=16, steps=1)
    with stdout_to_stderr():  # the engines' logs: standard output carries only the result
        result = calibrate(args.name, args.out, progress=lambda text: print(f"calibrate: {text}", file=sys.stderr,
                                                                            flush=True), **options)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        p = result["profile"]
        print(f"profile {p['name']} written to {result['path']}: {p['flops'] / 1e9:.1f} GFLOP/s fp32,"
              f" {p['bandwidth'] / 1e9:.1f} GB/s, all-reduce {p['collective_gbps'] / 1e9:.2f} GB/s per device"
              f" ({p['cores_per_device']} core(s) each, {p['processor']})", flush=True)
    return 0


def cmd_plan(args) -> int:
    """Print the ranked mappings of a config on N devices; returns the exit status."""
    from hybridlab.advisor.plan import plan, table
    from hybridlab.advisor.profile import load_profile
    from hybridlab.run_config import load_config

    profile = load_profile(args.profile)  # refused before the config's model is read
    cfg = load_config(args.config, args.overrides)
    found = plan(cfg, args.devices, profile, nodes=args.nodes, response_mean=args.response_mean)
    if args.json:
        print(json.dumps({"profile": profile.name, "devices": args.devices, "nodes": args.nodes, "candidates": [
            {"label": c.label, "mapping": c.mapping.to_dict(), "rejected": c.rejected,
             "prediction": None if c.prediction is None else {"step_s": c.prediction.step_s, "busy": c.prediction.busy,
                                                               "stage_s": c.prediction.stage_s,
                                                               "peak_memory_mb": c.prediction.peak_memory_mb}}
            for c in found]}), flush=True)
    else:
        print(f"profile {profile.name} ({profile.processor}); {args.devices} device(s) on {args.nodes} node(s)")
        print(table(found, top=args.top), flush=True)
    return 0


def add_commands(sub) -> None:
    """Add ``calibrate`` and ``plan`` to the ``hybridlab`` command's subparsers."""
    c = sub.add_parser("calibrate", help="measure this machine's device profile for the mapping advisor")
    c.add_argument("--json", action="store_true", help="print the saved profile as JSON")
    c.add_argument("--name", default="local", help="profile name (default: local, what plan reads by default)")
    c.add_argument("--out", default=None, help="write the profile here instead of ~/.cache/hybridlab/profiles")
    c.add_argument("--devices", type=int, default=0,
                   help="logical devices the cores are dealt to (default: one per core)")
    c.add_argument("--engine-model", default="small", help="zoo model the vLLM figures are measured on (default small)")
    c.add_argument("--train-models", default="tiny,small,mid",
                   help="zoo presets the training figures are measured on, comma-separated (default tiny,small,mid)")
    c.add_argument("--quick", action="store_true", help="fewer, shorter measurements (seconds, for a first look)")
    c.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("plan", help="rank the device mappings of a config by predicted step time",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=None, help="YAML file or preset name (omit for the default run)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--devices", type=int, required=True, help="devices to map the roles on")
    p.add_argument("--nodes", type=int, default=1, help="nodes the devices are on, equally (default 1)")
    p.add_argument("--profile", default=None, help="device profile: h100, h200, a100, h20, a JSON file or a saved name"
                                                   " (default: this machine's, from hybridlab calibrate)")
    p.add_argument("--response-mean", type=float, default=None,
                   help="mean generated tokens per sequence (default rollout.max_new_tokens)")
    p.add_argument("--top", type=int, default=10, help="runnable candidates to list (default 10)")
    p.add_argument("--json", action="store_true", help="print every candidate as JSON")
    p.set_defaults(func=cmd_plan)
