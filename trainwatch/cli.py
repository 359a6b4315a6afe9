"""The ``trainwatch`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from trainwatch.demo import BUGS, demo_log_dir, run_demo

    if args.list:
        for bug in BUGS.values():
            print(f"{bug.name:28s} {bug.expected_rule:22s} {bug.description}")
        return 0
    bug = None if args.bug == "none" else args.bug
    log_dir = args.log_dir if args.log_dir is not None else demo_log_dir()
    run_demo(bug, steps=args.steps, bug_at=args.bug_at, log_dir=log_dir, delay=args.delay)
    return 0


def _run(args: argparse.Namespace) -> int:
    from trainwatch.errors import ConfigError
    from trainwatch.runner import run_script

    try:
        return run_script(
            args.script,
            args.args,
            log_dir=args.log_dir,
            config=args.config,
            max_steps=args.max_steps,
            fail_on=args.fail_on,
            console=not args.no_console,
        )
    except ConfigError as exc:
        print(f"trainwatch run: {exc}", file=sys.stderr)
        return 2


def _report(args: argparse.Namespace) -> int:
    from trainwatch.report import report_main

    return report_main(args.path, as_json=args.json)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from trainwatch.demo import BUGS, DEFAULT_BUG

    parser = argparse.ArgumentParser(
        prog="trainwatch", description="Catch silent PyTorch training bugs while you train."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a short synthetic training run with a planted bug")
    demo.add_argument(
        "--bug",
        default=DEFAULT_BUG,
        choices=[*BUGS, "none"],
        help=f"which bug to plant (default: {DEFAULT_BUG}; 'none' for a healthy run)",
    )
    demo.add_argument("--list", action="store_true", help="list the bugs and exit")
    demo.add_argument("--steps", type=int, default=120)
    demo.add_argument("--bug-at", type=int, default=None, help="first step with the bug")
    demo.add_argument(
        "--log-dir",
        default=None,
        help="where alerts.jsonl and TensorBoard events go (default: runs/trainwatch/demo-<time>)",
    )
    demo.add_argument("--delay", type=float, default=0.01, help="seconds to pause per step")
    demo.set_defaults(handler=_demo)

    run = commands.add_parser(
        "run",
        help="run a training script unchanged, with every model and optimizer watched",
        description="Run SCRIPT as `python SCRIPT ARGS` would, with every model and "
        "optimizer it creates watched. The exit status is the script's own; with "
        "--fail-on, 3 when an alert at that level or above was raised.",
    )
    run.add_argument("--log-dir", default=None, help="default: runs/trainwatch/<timestamp>")
    run.add_argument("--config", default=None, help="a YAML config, e.g. configs/strict.yaml")
    run.add_argument("--max-steps", type=_positive, default=None, help="stop after N steps")
    run.add_argument(
        "--fail-on",
        choices=["never", "warning", "error"],
        default="never",
        help="exit 3 when an alert at this level or above was raised (default: never)",
    )
    run.add_argument("--no-console", action="store_true", help="no alerts on stderr")
    run.add_argument("script", help="the training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    run.set_defaults(handler=_run)

    report = commands.add_parser("report", help="summarise alerts.jsonl (or a log dir holding one)")
    report.add_argument("path", help="an alerts.jsonl file or a log dir")
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    report.set_defaults(handler=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
