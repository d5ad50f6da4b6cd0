"""``hvrep bench node --quick`` on 2 ranks under ``mpirun`` and under ``horovodrun --gloo`` (one launch each, side by
side): the profile's all-reduce figures, the backend each launcher gives, and ``hvrep plan`` reading the profile."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.multirank import harness

pytestmark = pytest.mark.multirank

TIMEOUT = 420  # one quick launch alone took 86 s at load average ~4 on 2 cores; two side by side, more
BACKEND = {"mpirun": ("mpi", "openmpi"), "horovodrun": ("gloo", "horovodrun")}  # launcher -> (backend, placement)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_node")

    def one(launcher: str):
        out = root / f"{launcher}.json"
        log = root / f"{launcher}.log"
        cmd = harness.two_ranks(launcher, ["-m", "hvrep.cli", "bench", "node", "--quick", "--out", str(out)])
        return harness.run_logged(cmd, log, TIMEOUT), out, log

    with ThreadPoolExecutor(len(BACKEND)) as pool:
        return dict(zip(BACKEND, pool.map(one, BACKEND), strict=True))


@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.parametrize("launcher", list(BACKEND))
def test_the_profile_holds_the_all_reduce_between_the_nodes_ranks(profiles, launcher: str) -> None:
    rc, out, log = profiles[launcher]
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert rc == 0 and out.is_file(), f"{launcher}: exit {rc}\n{tail}"
    p = json.loads(out.read_text())
    backend, placement = BACKEND[launcher]
    assert (p["ranks"], p["launcher"], p["allreduce"]["backend"]) == (2, placement, backend), p["allreduce"]
    assert p["allreduce"]["result_checked"] is True  # every size summed to 1 + 2 on both ranks
    points = p["allreduce"]["points"]
    sizes = [pt["bytes"] for pt in points]
    assert sizes[0] == 4096 and sizes == sorted(sizes) and len(sizes) >= 3, sizes
    for pt in points:
        assert 0 < pt["seconds_min"] <= pt["seconds"] <= pt["seconds_max"], pt
        # nccl-tests' definitions: algbw = bytes / time; busbw = algbw x 2(N-1)/N, here N = 2
        assert pt["algbw_GBps"] == pytest.approx(pt["bytes"] / pt["seconds"] / 1e9)
        assert pt["busbw_GBps"] == pytest.approx(pt["algbw_GBps"])
    assert p["allreduce"]["fit"]["bandwidth_GBps"] > 0
    # float16 through the same all-reduce: summed right (1 + 2 is exact in float16), and its γ in the plan's inputs
    half = p["allreduce_float16"]
    assert half["result_checked"] is True and [pt["bytes"] for pt in half["points"]] == sizes, half
    assert p["plan_inputs"]["gamma_s_per_byte"]["float16"] == half["gamma_s_per_byte"] >= 0
    # the codec of every scheme the plan prices, timed on the model's gradients
    assert set(p["plan_inputs"]["codec_s"]) == {"fp32", "fp16", "powersgd:1", "powersgd:2", "powersgd:4"}
    assert all(v > 0 for v in p["plan_inputs"]["codec_s"].values()), p["plan_inputs"]["codec_s"]
    # contention: forward + backward beside the same all-reduces on every rank, σ in the plan's inputs
    c = p["contention"]
    assert c["passes_beside"] >= 1 and c["collectives"] >= 1 and c["collective_bytes"] == p["model"]["grad_bytes"], c
    assert c["alone_s"] > 0 and c["beside_s"] > 0, c
    assert p["plan_inputs"]["overlap_slowdown"] == c["overlap_slowdown"] >= 0, c
    step = p["step"]
    assert all(step[k] > 0 for k in ("forward_s", "forward_backward_s", "step_no_reduce_s", "step_with_reduce_s"))
    assert p["host_device_copy"]["GBps"] is None  # no GPU here, said so
    assert p["plan_inputs"]["input_images_per_sec"] is None  # synthetic data is not an input pipeline


@pytest.mark.timeout(TIMEOUT + 120)
def test_hvrep_plan_reads_the_profile_and_its_measured_link(profiles, tmp_path) -> None:
    rc, out, log = profiles["mpirun"]
    assert rc == 0 and out.is_file(), log.read_text(errors="replace")[-3000:]
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"devices_per_node": 2, "intra": "profile",
                                   "inter": {"bandwidth_GBps": 0.1, "latency_us": 50}}))
    done = subprocess.run([sys.executable, "-m", "hvrep.cli", "plan", str(out), "--cluster", str(cluster), "--nodes",
                           "1,2,4", "--schemes", "fp32,fp16,powersgd:2,local:8"], capture_output=True, text=True,
                          timeout=120, cwd=harness.ROOT, env=harness.clean_env())
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| scheme")]
    assert len(rows) == 4 * 2 * 3, done.stdout  # 4 schemes x 2 topologies x 3 node counts
    # powersgd:2's codec is in the profile (ranks 1, 2, 4 timed): nothing counted 0
    assert "codec: not in the profile" not in done.stdout, done.stdout
