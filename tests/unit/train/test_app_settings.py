"""The example apps refuse a setting outside its range as ``hvrep train`` does: one line naming the setting, the
value and the range, exit 2, before any process or TensorFlow starts.

A NaN or out-of-range value used to start a run: the D4PG learner with samples_per_insert=nan waited for ever
(the watchdog then called it a hang, exit 75, and preemptible.sbatch requeued it up to 20 times).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from examples.d4pg import train as d4pg
from examples.sngan import train as sngan
from hvrep.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]

D4PG_BAD = [
    ("samples_per_insert=nan", r"samples_per_insert must be a finite number in \[0, inf\), got nan"),
    ("samples_per_insert=inf", r"samples_per_insert must be a finite number in \[0, inf\), got inf"),
    ("agent.gamma=1.5", r"agent\.gamma must be a finite number in \[0, 1\], got 1\.5\. Fix: e\.g\. agent\.gamma=0\.99"),
    ("agent.lr_critic=-0.001", r"agent\.lr_critic must be a finite number in \(0, inf\), got -0\.001"),
    ("agent.lr_policy=0", r"agent\.lr_policy must be a finite number in \(0, inf\), got 0\.0"),
    ("agent.v_max=nan", r"agent\.v_max must be a finite number"),
    ("agent.reward_scale=nan", r"agent\.reward_scale must be a finite number in \(0, inf\)"),
    ("sigma=nan", r"sigma must be a finite number in \[0, inf\)"),
    ("actor_steps_per_sec=-1", r"actor_steps_per_sec must be a finite number in \[0, inf\)"),
    ("steps=0", r"steps must be an integer in \[1, inf\), got 0"),
    ("eval_every=-5", r"eval_every must be an integer in \[0, inf\), got -5"),
    ("threads=0", r"threads must be an integer in \[1, inf\), got 0"),
    ("agent.hidden=0,256", r"agent\.hidden must be one or more layer widths >= 1"),
]
SNGAN_BAD = [
    ("gan.lr_g=-1", r"gan\.lr_g must be a finite number in \(0, inf\), got -1\.0"),
    ("gan.lr_d=nan", r"gan\.lr_d must be a finite number in \(0, inf\), got nan"),
    ("gan.beta2=1.0", r"gan\.beta2 must be a finite number in \[0, 1\), got 1\.0"),
    ("gan.ema_decay=nan", r"gan\.ema_decay must be a finite number in \[0, 1\), got nan"),
    ("steps=0", r"steps must be an integer in \[1, inf\), got 0"),
    ("checkpoint_every=-1", r"checkpoint_every must be an integer in \[0, inf\), got -1"),
]


@pytest.mark.parametrize(("setting", "message"), D4PG_BAD, ids=[s for s, _ in D4PG_BAD])
def test_d4pg_refuses_a_setting_outside_its_range(setting, message):
    with pytest.raises(ConfigError, match=message):
        d4pg.config([setting])


@pytest.mark.parametrize(("setting", "message"), SNGAN_BAD, ids=[s for s, _ in SNGAN_BAD])
def test_sngan_refuses_a_setting_outside_its_range(setting, message):
    with pytest.raises(ConfigError, match=message):
        sngan.config([setting])


def test_the_range_ends_pass():
    d4pg.config(["agent.gamma=1", "samples_per_insert=0", "agent.tau=1", "eval_every=0"])
    d4pg.config(["agent.gamma=0"])
    sngan.config(["gan.beta1=0", "gan.ema_decay=0"])


@pytest.mark.parametrize(("module", "setting"), [("examples.d4pg.train", "samples_per_insert=nan"),
                                                  ("examples.sngan.train", "gan.lr_d=-0.1")])
def test_the_command_line_says_it_in_one_line_and_exits_2(tmp_path, module, setting):
    done = subprocess.run([sys.executable, "-m", module, f"output_dir={tmp_path / 'run'}", setting], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    app = module.split(".")[1]
    lines = [line for line in done.stderr.splitlines() if line.startswith(f"{app}:")]  # not TensorFlow's import
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{app}: error: {setting.split('=')[0]} must be a finite number in")
    assert not (tmp_path / "run").exists()  # nothing started
