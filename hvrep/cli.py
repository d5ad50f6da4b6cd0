"""The ``hvrep`` command. The only module in hvrep that parses flags (STYLE.md, principle 3).

Subcommands are added by the issues that own them (train, data, launch,
bench, report); each lives in its module and is wired here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from hvrep._version import __version__
from hvrep.errors import HvrepError


def _doctor(args: argparse.Namespace) -> int:
    from hvrep.cluster import doctor

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


def _data_demo(args: argparse.Namespace) -> int:
    from hvrep.data import write_demo

    result = write_demo(args.dst, size=args.size, progress=True)
    print(f"demo data in {args.dst}: folder/ (ImageNet layout) and tfrecord/ "
          f"({result.written['train']} train, {result.written['val']} val images)")
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from hvrep.data import prepare

    result = prepare(args.src, args.dst, train_shards=args.train_shards, val_shards=args.val_shards,
                     on_error=args.on_error, seed=args.seed, progress=True)
    print(f"{args.dst}: {result.written['train']} train and {result.written['val']} val images; "
          f"{result.shards_written} shards written, {result.shards_reused} reused from an earlier run")
    for split, files in result.skipped.items():
        if files:
            print(f"skipped {len(files)} bad {split} file(s), listed in the manifest: {', '.join(files[:5])}",
                  file=sys.stderr)
    return 0


def _launch(args: argparse.Namespace) -> int:
    from hvrep.cluster import launch

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip()) if args.hosts else None
    spec = launch.LaunchSpec(
        np=args.np, command=tuple(command), hosts=hosts, launcher=args.launcher, bind=args.bind, gloo=args.gloo,
        allow_run_as_root=args.allow_run_as_root, overcommit=args.overcommit,
        extra=tuple(shlex.split(args.launcher_args)), min_np=args.min_np, max_np=args.max_np,
        host_discovery_script=args.host_discovery_script,
    )
    if args.dry_run:
        print(launch.format_argv(spec))
        return 0
    return launch.run(spec)


def _build_parser() -> argparse.ArgumentParser:
    from hvrep.cluster.launch import BINDINGS, LAUNCHERS

    parser = argparse.ArgumentParser(prog="hvrep", description="Replicated TensorFlow training on Horovod.")
    parser.add_argument("--version", action="version", version=f"hvrep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train a ResNet on every rank (see `hvrep train --help`)", add_help=False)
    sub.add_parser("bench", help="throughput benchmark and scaling sweep (see `hvrep bench --help`)",
                   add_help=False)
    sub.add_parser("plan", help="predict step time and scaling per scheme from a node profile and a cluster (see "
                   "`hvrep plan --help`)", add_help=False)
    sub.add_parser("report", help="scaling report from run dirs / benchmark results (see `hvrep report --help`)",
                   add_help=False)
    sub.add_parser("netbed", help="several hosts on this machine: network namespaces on shaped links (root; "
                   "see `hvrep netbed --help`)", add_help=False)

    p = sub.add_parser("doctor", help="print the environment a bug report needs; check requirements")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--require", default="", metavar="LIST",
        help="comma-separated pieces that must be present, e.g. horovod,mpi,gloo,dali,nccl,gpu,tpu; "
        "exit 1 with the fix for each missing one",
    )
    p.add_argument("--quick", action="store_true", help="skip importing TensorFlow and Horovod")
    p.set_defaults(func=_doctor)

    data = sub.add_parser("data", help="data sets: the embedded demo, JPEG folder to TFRecord").add_subparsers(
        dest="data_command", required=True)
    p = data.add_parser("demo", help="write the demo data set (real digit images from scikit-learn) to DST")
    p.add_argument("dst")
    p.add_argument("--size", type=int, default=32, help="image side in pixels")
    p.set_defaults(func=_data_demo)
    p = data.add_parser("prepare", help="convert an ImageNet-style JPEG folder to TFRecord shards + DALI indexes")
    p.add_argument("src", help="folder with train/<class>/*.JPEG and val/<class>/*.JPEG")
    p.add_argument("dst", help="output folder (resumable)")
    p.add_argument("--train-shards", type=int, default=None)
    p.add_argument("--val-shards", type=int, default=None)
    p.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="a bad JPEG stops the run (raise) or is left out and listed (skip)")
    p.add_argument("--seed", type=int, default=0, help="the shuffle that spreads classes over shards")
    p.set_defaults(func=_data_prepare)

    p = sub.add_parser(
        "launch", help="start N ranks with horovodrun, mpirun or srun, set up right (see hvrep/cluster/launch.py)",
        usage="hvrep launch --np N [options] -- CMD...",
    )
    p.add_argument("--np", type=int, required=True, help="number of ranks")
    p.add_argument("--hosts", default="", metavar="H:S,...",
                   help="hosts and their slots, e.g. node1:4,node2:4 (default: this machine)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="horovodrun")
    p.add_argument("--bind", choices=BINDINGS, default="none",
                   help="process binding (default none: training processes are multi-threaded)")
    p.add_argument("--gloo", action=argparse.BooleanOptionalAction, default=True,
                   help="horovodrun only: Gloo (default) or, with --no-gloo, MPI as the controller")
    p.add_argument("--allow-run-as-root", action="store_true",
                   help="mpirun only: let Open MPI run as root (containers, CI)")
    p.add_argument("--overcommit", action="store_true",
                   help="allow more ranks than CPUs: srun --overcommit (without it `srun -n 3` on a 2-CPU node "
                   "waits forever), mpirun --map-by slot:OVERSUBSCRIBE")
    p.add_argument("--launcher-args", default="", metavar="ARGS",
                   help="more launcher arguments, one shell-quoted string, e.g. '--mca btl_tcp_if_include eth0'")
    p.add_argument("--min-np", type=int, default=None, help="elastic (horovodrun): the smallest world size")
    p.add_argument("--max-np", type=int, default=None, help="elastic (horovodrun): the largest world size")
    p.add_argument("--host-discovery-script", default=None, metavar="S",
                   help="elastic (horovodrun): an executable printing the hosts (host:slots lines); an elastic "
                   "launch of hvrep train is checked against --min-np/--max-np before it starts")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the program every rank runs")
    p.set_defaults(func=_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # the training app has its own flags and overrides
        from hvrep.train.main import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["bench"]:
        from hvrep.perf.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["plan"]:  # pure Python: no TensorFlow imported
        from hvrep.perf.plan import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["report"]:
        from hvrep.perf.report import main as report_main

        return report_main(argv[1:])
    if argv[:1] == ["netbed"]:
        from hvrep.cluster.netbed import main as netbed_main

        try:
            return netbed_main(argv[1:])
        except HvrepError as e:
            print(f"hvrep netbed: error: {e}", file=sys.stderr)
            return 2
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
