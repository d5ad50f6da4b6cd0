"""`make demo`'s job, as it runs there: 2 ranks under horovodrun --gloo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def test_demo_trains_to_90_percent_with_identical_replicas(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "hvrep.demo",
           "--data-dir", str(tmp_path / "demo-data")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "2 replica(s) (horovod)" in res.stdout and "digit JPEGs via tfdata" in res.stdout
    assert (tmp_path / "demo-data" / "tfrecord" / "hvrep-manifest.json").is_file()  # read through the pipeline
    assert "weights identical on all 2 replicas: True" in res.stdout
    final = re.findall(r"val top-1 (\d+)/(\d+)", res.stdout)[-1]
    assert int(final[0]) / int(final[1]) > 0.9
    # Only the chief prints: one line per epoch.
    assert len(re.findall(r"epoch \d+/20", res.stdout)) == 20
