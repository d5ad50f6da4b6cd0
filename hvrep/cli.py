"""The ``hvrep`` command. The only module in hvrep that parses flags.

Subcommands are added by the issues that own them (train, data, launch,
bench, report); each lives in its module and is wired here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hvrep._version import __version__
from hvrep.errors import HvrepError


def _doctor(args: argparse.Namespace) -> int:
    from hvrep import doctor

    required = [r.strip() for r in args.require.split(",") if r.strip()] if args.require else []
    info = doctor.collect(with_tensorflow=not args.quick)
    problems = doctor.missing(info, required)
    if args.json:
        print(json.dumps({**info, "missing": problems}, indent=2, default=str))
    else:
        print(doctor.format_text(info))
    for line in problems:
        print(f"hvrep doctor: {line}", file=sys.stderr)
    return 1 if problems else 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvrep", description="Replicated TensorFlow training on Horovod.")
    parser.add_argument("--version", action="version", version=f"hvrep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="print the environment a bug report needs; check requirements")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--require", default="", metavar="LIST",
        help="comma-separated pieces that must be present, e.g. horovod,mpi,gloo,dali,nccl,gpu,tpu; "
        "exit 1 with the fix for each missing one",
    )
    p.add_argument("--quick", action="store_true", help="skip importing TensorFlow and Horovod")
    p.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    # Keep TensorFlow's C++ start-up chatter out of the command's output.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return int(args.func(args))
    except HvrepError as e:
        print(f"hvrep: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
