"""benchmarks/slow_links.py's argument checks and --quick mode (no bed: the benchmark itself needs root and minutes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "slow_links.py"


@pytest.fixture(scope="module")
def sl():
    spec = importlib.util.spec_from_file_location("slow_links_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_defaults_are_the_issues_eight_schemes_at_two_rates(sl):
    args = sl.parse_args([])
    assert args.schemes == ["sync_fp32", "sync_fp16", "powersgd_r1", "powersgd_r4", "local_h4", "local_h4_nesterov",
                            "local_h16", "local_h16_nesterov"]
    assert args.link_gbit == [0.1, 1.0] and args.seeds == [0, 1, 2] and not args.quick
    assert args.steps % args.eval_every == 0 and args.eval_every % 16 == 0
    # DiLoCo-style schemes at small H: a steady delta applied once (outer_lr / (1 - outer_momentum) = 1).
    assert args.outer_lr / (1 - args.outer_momentum) == pytest.approx(1.0)


def test_quick_is_tiny_and_still_checked(sl):
    args = sl.parse_args(["--quick", "--steps", "999"])
    assert (args.seeds, args.steps, args.eval_every, args.width) == ([0], 32, 16, 256)
    assert args.val_examples <= 1000


@pytest.mark.parametrize(("argv", "message"), [
    (["--eval-every", "8"], "multiple of every local SGD H (16)"),
    (["--eval-every", "8", "--schemes", "sync_fp32,local_h4"], None),  # no H = 16: 8 is fine
    (["--steps", "100"], "must be a multiple of --eval-every 32"),
    (["--schemes", "sync_fp32,dgc"], "unknown ['dgc']"),
    (["--schemes", "sync_fp32,sync_fp32"], "twice"),
    (["--seeds", "0,0"], "distinct"),
    (["--target", "91"], "accuracy in (0, 1)"),
    (["--link-gbit", "0"], "must be in [0.001, 100]"),
    (["--max-train-s", "0"], "must be > 0"),
    (["--outer-momentum", "1"], "--outer-momentum in [0, 1)"),
])
def test_bad_arguments_are_refused_naming_the_fix(sl, capsys, argv, message):
    if message is None:
        assert sl.parse_args(argv).eval_every == 8
        return
    with pytest.raises(SystemExit) as e:
        sl.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_each_seed_runs_the_schemes_in_another_order(sl):
    schemes = ["a", "b", "c"]
    assert [sl.rotated(schemes, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                          ["a", "b", "c"]]
