"""The ``hybridlab`` command line. User mistakes print ``error: ...`` and exit 2, no traceback."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hybridlab.config.schema import DataConfig, WarmStartConfig
from hybridlab.errors import UserError


def _quiet_libraries() -> None:
    """Silence library progress bars and hub look-ups that mean nothing for local models."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _task_from_args(args):
    from hybridlab.tasks import get_task, parse_task_options

    return get_task(args.task, **parse_task_options(args.task_opt))


def cmd_zoo(args) -> int:
    """Build or list zoo models; returns the exit status."""
    from hybridlab.models import zoo
    from hybridlab.tasks import parse_task_options

    if args.zoo_cmd == "list":
        for name in zoo.PRESETS:
            for arch in zoo.ARCHS:
                full = name if arch == "qwen2" else f"{name}-{arch}"
                print(f"{full:14s} {arch:8s} {zoo.count_parameters(full) / 1e6:6.2f}M parameters")
        return 0
    if args.task_opt and not args.task:
        raise UserError("--task-opt: give --task too (the task whose text the tokenizer is trained on)")
    corpus = zoo.task_corpus(args.task, parse_task_options(args.task_opt)) if args.task else None
    out = zoo.build(args.preset, args.out, seed=args.seed, corpus=corpus and corpus[1])
    print(out)
    return 0


def cmd_sft(args) -> int:
    """Run a supervised warm start and save the checkpoint; returns the exit status."""
    from hybridlab import sft
    from hybridlab.atomic import check_model_dir_target
    from hybridlab.evaluate import accuracy, load_hf
    from hybridlab.models.zoo import resolve_model
    from hybridlab.tasks import parse_task_options

    task = _task_from_args(args)
    cfg = sft.SFTConfig(steps=args.steps, max_seconds=args.max_seconds, lr=args.lr,
                        batch_size=args.batch_size, seed=args.seed,
                        train_samples=args.train_samples, target_accuracy=args.target_accuracy)
    cfg.validate()
    out = check_model_dir_target(args.out)  # before the expensive part
    data = DataConfig(task=args.task, task_options=parse_task_options(args.task_opt))
    model, tokenizer = load_hf(resolve_model(args.model, data=data))  # a task's own tokenizer where it asks for one
    summary = sft.train(model, tokenizer, task, cfg)
    sft.save_checkpoint(model, tokenizer, out)
    result = {"out": str(out), "task": args.task, "steps": summary["steps"], "seconds": summary["seconds"],
              "first_loss": round(summary["first_loss"], 4), "final_loss": round(summary["final_loss"], 4)}
    if args.target_accuracy is not None:
        result["held_out_accuracy"] = summary["held_out_accuracy"]
    if args.eval > 0:
        result["test_accuracy"] = accuracy(model, tokenizer, task, task.split("test", args.eval))["accuracy"]
    print(json.dumps(result))
    return 0


def cmd_eval(args) -> int:
    """Print greedy accuracy on a task or dataset; returns the exit status."""
    from hybridlab.evaluate import accuracy, load_hf
    from hybridlab.models.zoo import resolve_model
    from hybridlab.tasks import parse_task_options

    if args.data:
        from hybridlab.scorers import ScorerOptions
        from hybridlab.tasks.dataset import load_dataset
        from hybridlab.workers.reward.scoring import RuleScorer, check_sources

        samples = load_dataset(args.data, limit=args.n)
        check_sources(samples, ScorerOptions())  # before the model loads
        task, name = RuleScorer(), ",".join(sorted({s.data_source for s in samples}))
    else:
        task = _task_from_args(args)
        samples, name = task.split("test", args.n, seed=args.seed), task.name
    data = DataConfig(task=args.task, task_options=parse_task_options(args.task_opt)) if args.task else None
    model, tokenizer = load_hf(resolve_model(args.model, data=data))  # the model a run on the task builds
    result = accuracy(model, tokenizer, task, samples, max_new_tokens=args.max_new_tokens)
    result = {"model": str(args.model), "task": name, **result}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{name}: greedy accuracy {result['accuracy']:.3f} on {result['n']} test prompts "
              f"({result['seconds']} s)")
        for ex in result["examples"]:
            print(f"  {ex['prompt']!r} -> {ex['response']!r} {'ok' if ex['correct'] else 'wrong'}")
    return 0


def cmd_data(args) -> int:
    """Write a task split as a verl-format file (or as preference pairs in TRL's columns);
    returns the exit status."""
    from hybridlab.tasks.dataset import save_dataset
    from hybridlab.tasks.preferences import save_preferences, task_pairs

    if args.chat and not args.preferences:
        raise UserError("--chat writes preference pairs as chat messages, so it needs --preferences (for a run on the"
                        " task's prompts as chat messages, set data.chat=true)")
    task = _task_from_args(args)
    if args.preferences:
        print(save_preferences(task_pairs(task, args.split, args.n, seed=args.seed, chat=args.chat), args.out))
    else:
        print(save_dataset(task.split(args.split, args.n, seed=args.seed), args.out))
    return 0


def cmd_dashboard(args) -> int:
    """Serve a run's live dashboard, or the runs page of a folder of runs, until interrupted;
    returns the exit status."""
    from pathlib import Path

    from hybridlab.telemetry.hub import TELEMETRY_FILE
    from hybridlab.telemetry.serving import check_serving, free_port, is_runs_root, serve

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"no run directory {str(run_dir)!r} (hybridlab train prints it; or give a folder of runs)")
    check_serving(args.address, args.basic_auth, args.oauth_provider)  # before anything else
    what = "runs under" if is_runs_root(run_dir) else "dashboard of"
    if what == "dashboard of" and not (run_dir / TELEMETRY_FILE).is_file():
        print(f"note: {run_dir} has no {TELEMETRY_FILE} yet; the page fills in when the run writes it", flush=True)
    port = args.port or free_port(args.address)
    login = " (log in first)" if args.basic_auth or args.oauth_provider else ""
    print(f"{what} {run_dir} on http://{args.address}:{port}/{login}", flush=True)
    serve(run_dir, port=port, address=args.address, show=False, threaded=False, basic_auth=args.basic_auth,
          oauth_provider=args.oauth_provider)
    return 0


def cmd_explain(args) -> int:
    """Print the sizes a config implies, its mapping and memory per worker (with ``--service
    tinker``: what the Tinker service would run where); returns the exit status."""
    from hybridlab.explain import explain
    from hybridlab.run_config import load_run

    if args.service == "tinker":  # the service's settings file and KEY=VALUE settings, as `serve tinker` takes them
        from hybridlab.tinker.service import TinkerService
        from hybridlab.tinker.settings import load_settings

        print(TinkerService(load_settings(args.config, args.overrides)).explain(), flush=True)
        return 0

    cfg, verl = load_run(args.config, args.overrides, verl=args.verl)
    print(explain(cfg).text(), flush=True)
    if verl is not None:
        print("\n" + verl.report(), flush=True)
    return 0


def cmd_bench(args) -> int:
    """Run a benchmark and print its JSON; returns the exit status."""
    from hybridlab.environment import stdout_to_stderr, use_loopback

    use_loopback()  # a benchmark's clusters, engines and runs (their processes inherit it) stay on loopback
    from hybridlab.bench import run

    options = {}
    pairs = list(args.opt)
    extra = list(getattr(args, "extra", []))
    while extra:  # --some-option VALUE flags, e.g. --model small --steps 3
        flag = extra.pop(0)
        if not flag.startswith("--") or not extra:
            raise UserError(f"benchmark option {flag!r} must look like --name VALUE")
        pairs.append(f"{flag[2:]}={extra.pop(0)}")
    for pair in pairs:
        key, _, value = pair.partition("=")
        if not value:
            raise UserError(f"benchmark option {pair!r} must look like key=value")
        options[key.replace("-", "_")] = int(value) if value.isdigit() else value
    with stdout_to_stderr():  # standard output carries only the JSON
        try:
            result = run(args.name, **options)
        except TypeError as exc:
            raise UserError(f"benchmark {args.name!r}: {exc}") from None
    print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
    if args.json and args.command_line:
        # Ray forwards its workers' output to this process asynchronously, until the process exits:
        # whatever arrives after the JSON goes to standard error, so that standard output is the JSON alone
        os.dup2(2, 1)
    return 0


def _add_task_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--task", required=required, help="task name: arith, reverse or countdown")
    p.add_argument("--task-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="task option, e.g. digits=3 or ops=+-* (repeatable)")


def _add_zoo(sub) -> None:
    """The ``hybridlab zoo`` command."""
    zoo = sub.add_parser("zoo", help="build or list local zoo models")
    zsub = zoo.add_subparsers(dest="zoo_cmd", required=True, metavar="ACTION")
    zb = zsub.add_parser("build", help="build a zoo preset into a checkpoint directory")
    zb.add_argument("preset", help="tiny, small or mid, optionally with -llama (e.g. tiny-llama)")
    zb.add_argument("--out", required=True, help="directory to write the checkpoint to")
    zb.add_argument("--seed", type=int, default=0)
    _add_task_args(zb, required=False)  # a task that asks for its own tokenizer (reasoning_gym) gets one
    zsub.add_parser("list", help="list presets with their parameter counts")
    zoo.set_defaults(func=cmd_zoo)


def _add_sft(sub) -> None:
    """The ``hybridlab sft`` command."""
    s = sub.add_parser("sft", help="supervised warm start on a task's worked examples")
    _add_task_args(s)
    s.add_argument("--model", default="tiny", help="zoo preset or local checkpoint directory")
    s.add_argument("--out", required=True, help="where to save the trained HF checkpoint")
    s.add_argument("--steps", type=int, default=WarmStartConfig.max_steps, help="the cap (warm_start.max_steps)")
    s.add_argument("--max-seconds", type=float, default=170.0, help="stop early after this long")
    s.add_argument("--lr", type=float, default=WarmStartConfig.lr)
    s.add_argument("--batch-size", type=int, default=WarmStartConfig.batch_size)
    s.add_argument("--train-samples", type=int, default=4000, help="distinct training prompts to draw")
    s.add_argument("--target-accuracy", type=float, default=None, metavar="FRACTION",
                   help="stop once greedy accuracy on 200 held-out training prompts reaches this (e.g. 0.5);"
                        " --steps is then the cap, and missing the target is an error")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--eval", type=int, default=500, metavar="N",
                   help="greedy accuracy on N test prompts afterwards (0: skip)")
    s.set_defaults(func=cmd_sft)


def _add_eval(sub) -> None:
    """The ``hybridlab eval`` command."""
    e = sub.add_parser("eval", help="greedy accuracy of a model on a task or a verl dataset")
    _add_task_args(e, required=False)
    e.add_argument("--data", help="a verl-format parquet or JSONL file instead of --task")
    e.add_argument("--model", required=True, help="zoo preset or local checkpoint directory")
    e.add_argument("--n", type=int, default=500, help="number of test prompts")
    e.add_argument("--max-new-tokens", type=int, default=16)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_eval)


def _add_data(sub) -> None:
    """The ``hybridlab data`` command."""
    d = sub.add_parser("data", help="write a task split as a verl-format parquet or JSONL file")
    _add_task_args(d)
    d.add_argument("--split", default="train", choices=["train", "test"])
    d.add_argument("--n", type=int, default=1000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", required=True, help="file ending in .parquet or .jsonl")
    d.add_argument("--preferences", action="store_true",
                   help="write preference pairs in TRL's columns (prompt, chosen, rejected): the worked answer"
                        " against a plausible wrong one")
    d.add_argument("--chat", action="store_true", help="with --preferences: the pairs as chat messages")
    d.set_defaults(func=cmd_data)


def _add_explain(sub) -> None:
    """The ``hybridlab explain`` command."""
    e = sub.add_parser("explain", help="print what a config implies: sizes per step, update, rank; the mapping;"
                                       " memory per worker")
    e.add_argument("config", nargs="?", default=None, help="YAML file or preset name (omit for the default run)")
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    e.add_argument("--verl", action="store_true", help="read the settings as verl's main_ppo does (docs/verl.md)")
    e.add_argument("--service", choices=("tinker",), default=None,
                   help="explain a service's settings instead (tinker: what `hybridlab serve tinker` would run where)")
    e.set_defaults(func=cmd_explain)


def _add_dashboard(sub) -> None:
    """The ``hybridlab dashboard`` command."""
    dash = sub.add_parser("dashboard", help="serve a run's live dashboard (replays finished runs), or the runs page"
                                            " of a folder of runs")
    dash.add_argument("run_dir", help="the run directory hybridlab train printed, or a folder of run directories")
    dash.add_argument("--port", type=int, default=5006)
    dash.add_argument("--address", default="localhost",
                      help="interface to bind (default: localhost only; any other needs --basic-auth or --oauth-provider)")
    dash.add_argument("--basic-auth", metavar="PASSWORD_FILE", default=None,
                      help="Panel's login with a JSON file {\"user\": \"password\"}")
    dash.add_argument("--oauth-provider", metavar="NAME", default=None,
                      help="Panel's OAuth login (github, google, ...; PANEL_OAUTH_KEY and PANEL_OAUTH_SECRET set)")
    dash.set_defaults(func=cmd_dashboard)


def _add_bench(sub) -> None:
    """The ``hybridlab bench`` command."""
    b = sub.add_parser("bench", help="run a benchmark (prints JSON: ratios against a baseline in one run)")
    b.add_argument("name", help="benchmark name, e.g. dispatch")
    b.add_argument("--json", action="store_true", help="print one JSON object on one line")
    b.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="benchmark option (also accepted as --key VALUE, e.g. --model small --steps 3)")
    b.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``hybridlab`` command."""
    parser = argparse.ArgumentParser(prog="hybridlab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    from hybridlab.advisor.commands import add_commands
    from hybridlab.score_command import add_command as add_score
    from hybridlab.serve_command import add_command as add_serve
    from hybridlab.train_command import add_command as add_train

    for add in (_add_zoo, _add_sft, _add_eval, _add_data, add_train, _add_explain, add_score, add_commands,
                _add_dashboard, add_serve, _add_bench):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "cmd", None) != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    args.command_line = argv is None  # this process is the `hybridlab` command, not a call from Python
    if args.command_line:  # one session per process here: no warm pool (controller/warm_pool.py) to fill for the next
        os.environ["HYBRIDLAB_WARM_PROCESSES"] = "0"
    if getattr(args, "config", None) and "=" in args.config and hasattr(args, "overrides"):
        # train, explain, plan, score: argparse took the first override for a config; only overrides were given
        args.overrides, args.config = [args.config, *args.overrides], None
    if getattr(args, "cmd", None) == "eval" and not (args.task or args.data):
        print("error: eval needs --task NAME or --data FILE", file=sys.stderr)
        return 2
    try:
        _quiet_libraries()
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
