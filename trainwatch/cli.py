"""The ``trainwatch`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from trainwatch.demo import BUGS, run_demo

    if args.list:
        for bug in BUGS.values():
            print(f"{bug.name:20s} {bug.description}  -> {bug.expected_rule}")
        return 0
    bug = None if args.bug == "none" else args.bug
    run_demo(bug, steps=args.steps, bug_at=args.bug_at, log_dir=args.log_dir, delay=args.delay)
    return 0


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
    demo.add_argument("--log-dir", default=None, help="also write alerts.jsonl here")
    demo.add_argument("--delay", type=float, default=0.01, help="seconds to pause per step")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
