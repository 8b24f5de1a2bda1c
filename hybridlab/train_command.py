"""``hybridlab train``: an RL run from a config, a preset or a verl run script's settings, or a
run resumed from its latest checkpoint; SIGTERM and SIGINT stop it cleanly at a step boundary."""
from __future__ import annotations

import dataclasses
import signal
import sys
from pathlib import Path

import yaml

from hybridlab.errors import UserError


def _verl_resume(verl, cfg) -> str | None:
    """Return the run directory to resume under verl's ``resume_mode``, or None to start afresh.
    auto: ``trainer.default_local_dir`` when it holds a checkpoint. resume_path:
    ``trainer.resume_from_path``, a run directory (its latest checkpoint) or a checkpoint; in its own
    run directory only the latest goes on (older ones are refused: the newer ones would be resumed
    from or pruned in their place); another run's checkpoint starts ``default_local_dir`` from it,
    as verl writes into that directory. Raises UserError before anything is written."""
    from hybridlab.dataflow import checkpoints

    run_dir = Path(cfg.trainer.run_dir)
    if verl.resume == "auto" and run_dir.is_dir() and checkpoints.checkpoint_dirs(run_dir):
        _same_adapter(cfg, checkpoints.latest(run_dir))
        return str(run_dir)
    if verl.resume != "resume_path":
        return None
    path = Path(verl.resume_from)
    if not path.is_dir():
        raise UserError(f"trainer.resume_from_path={path}: no such checkpoint (RUN/checkpoints/step-N) or run directory")
    checkpoint = path if (path / "session.json").is_file() else checkpoints.latest(path)
    _same_adapter(cfg, checkpoint)
    source = checkpoint.parent.parent
    if source.resolve() == run_dir.resolve():
        latest = checkpoints.latest(source)
        if latest.resolve() != checkpoint.resolve():
            raise UserError(f"trainer.resume_from_path={path}: its run has a newer checkpoint, {latest.name}, and"
                            " trainer.default_local_dir is that run: going on from an older one there would leave the"
                            " newer ones to be resumed from or pruned in its place. Set trainer.default_local_dir to a"
                            f" new directory to go on from {checkpoint.name} there (the run stays as it is)")
        return str(source)
    if checkpoints.branched_from(run_dir) == checkpoint.resolve():  # the same command again: go on in the branch
        return str(run_dir)
    checkpoints.branch(checkpoint, run_dir)
    print(f"{run_dir} starts from {checkpoint} (trainer.resume_from_path)", flush=True)
    return str(run_dir)


def _same_adapter(cfg, checkpoint: Path) -> None:
    """Raise UserError when the settings ask for another LoRA adapter than the checkpoint holds."""
    saved = (yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}).get("actor", {}).get("lora", {})
    wanted = dataclasses.asdict(cfg.actor.lora)
    changed = sorted(k for k in wanted if k in saved and saved[k] != wanted[k])
    if changed:
        raise UserError(f"actor.lora.{changed[0]}: the settings ask for {wanted[changed[0]]!r}, and the checkpoint in"
                        f" {checkpoint.parent.parent} holds an adapter built with {saved[changed[0]]!r}; resume with the"
                        " run's own LoRA settings, or set trainer.resume_mode=disable to start afresh")


def cmd_train(args) -> int:
    """Run RL training from a config (default: GRPO on arith with tiny), or resume a run from
    its latest checkpoint; returns the exit status."""
    from hybridlab.dataflow.session import RLSession
    from hybridlab.run_config import load_run

    ray = dict(ray_address=args.ray_address, ray_temp_dir=args.ray_temp_dir)
    cfg, verl = (None, None) if args.resume else load_run(args.config, args.overrides, verl=args.verl)
    if verl is not None:  # a verl run: what its settings became, and verl's resume_mode
        print(verl.report(), flush=True)
        args.resume = _verl_resume(verl, cfg)
    if args.resume:
        overrides = list(args.overrides)
        if args.config:
            raise UserError(f"--resume continues the run with its own config.yaml; give no config ({args.config!r}),"
                            " only key=value overrides")
        from hybridlab.dataflow import checkpoints

        latest = checkpoints.latest(Path(args.resume))
        print(f"resuming {args.resume} from {latest.name}", flush=True)
        if verl is not None:  # the run's settings again, as verl reads them from its command line
            overrides = [o for o in verl.overrides() if not o.startswith("actor.lora.")]  # checked by _verl_resume
        rl = RLSession.resume(args.resume, overrides, **ray)
    else:
        rl = RLSession(cfg, **ray)
        print(f"run directory: {rl.run_dir}", flush=True)
    try:
        rl.start()  # first: starting Ray installs its own SIGTERM handler, which ours replaces
        _stop_on_signals(rl)
        summary = rl.train()
    finally:
        rl.shutdown()
    print(f"accuracy before {summary['accuracy_before']:.3f} -> after {summary['accuracy_after']:.3f} "
          f"({summary['steps']} steps, {summary['rl_seconds']} s; stopped by {summary['stopped_by']})")
    print(f"summary: {rl.run_dir / 'summary.json'}", flush=True)
    if summary["stopped_by"] != "steps":
        print(f"resume with: hybridlab train --resume {rl.run_dir}", flush=True)
    if summary["failed"]:
        print(f"error: {summary['stopped_by']}", file=sys.stderr, flush=True)
        return 1
    return 0


def _stop_on_signals(rl) -> None:
    """First Ctrl-C or SIGTERM: stop after the current step, checkpoint, print how to resume.
    A second one stops at once (KeyboardInterrupt); checkpoints are atomic, so the latest
    complete one stays intact."""
    signals = []

    def handler(signum, frame) -> None:
        signals.append(signum)
        if len(signals) > 1:
            raise KeyboardInterrupt
        rl.request_stop()
        print(f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint"
              " (again to stop at once)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def add_command(sub) -> None:
    """Add ``train`` to the ``hybridlab`` command's subparsers."""
    t = sub.add_parser("train", help="RL training from a config or preset (default: GRPO on arith, tiny model)")
    t.add_argument("config", nargs="?", default=None,
                   help="YAML file or preset name in configs/ (grpo, ppo, rloo, ...); omit for the default run")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. trainer.steps=50")
    t.add_argument("--ray-address", default=None, help="attach to an existing Ray cluster (e.g. auto)")
    t.add_argument("--ray-temp-dir", default=None, help="temp folder of a local Ray cluster (short path)")
    t.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue this run from its latest complete checkpoint (its config, plus overrides)")
    t.add_argument("--verl", action="store_true",
                   help="read the KEY=VALUE settings as verl's main_ppo does (automatic when they name"
                        " actor_rollout_ref): verl's defaults, keys and placement (docs/verl.md)")
    t.set_defaults(func=cmd_train)
