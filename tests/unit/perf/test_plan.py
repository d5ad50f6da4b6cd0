"""hvrep plan (hvrep/perf/plan.py) against cases of its equations worked out by hand (docs/planning.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hvrep.errors import ConfigError
from hvrep.perf import plan
from hvrep.perf.costmodel import Interconnect


def _cluster(g: int, intra=(10.0, 1.0), inter=(2.0, 10.0), algorithm: str = "ring") -> plan.Cluster:
    return plan.Cluster(g, Interconnect("intra", *intra), Interconnect("inter", *inter), algorithm)


def _profile(**kw) -> plan.Profile:
    base = dict(name="hand", per_replica_batch=32, forward_s=1.0, backward_s=2.0, grad_bytes=8e9, tensors=1,
                beta_s=0.1, cycle_s=0.0)
    return plan.Profile(**{**base, **kw})


# --- all-reduce time ---

def test_flat_ring_across_nodes_pays_each_hops_latency_and_its_slowest_links_bandwidth():
    # N = 8 (2 nodes x 4): 14 steps, 2*2 = 4 across the network (10 µs), 10 inside a node (1 µs);
    # 2*7/8 * 1e9 B at the slower link, 2e9 B/s
    assert plan.allreduce_s(1e9, 2, _cluster(4), "ring") == pytest.approx(4 * 10e-6 + 10 * 1e-6 + 0.875, rel=1e-12)
    # one device per node: every step crosses the network: 2*3*10 µs + 2*3/4 * 1e9/2e9
    assert plan.allreduce_s(1e9, 4, _cluster(1), "ring") == pytest.approx(6 * 10e-6 + 0.75, rel=1e-12)


def test_hierarchical_is_a_ring_in_the_node_plus_a_ring_between_nodes():
    # 2*3*1 µs + 2*3/4 * 1e9/10e9  +  2*1*10 µs + 2*1/2 * 1e9/2e9
    assert plan.allreduce_s(1e9, 2, _cluster(4), "hierarchical") == pytest.approx(6e-6 + 0.15 + 2e-5 + 0.5,
                                                                                  rel=1e-12)


def test_halving_doubling_between_nodes_takes_2_log2_m_latency_steps():
    # 8 nodes of 1: 2*log2(8) = 6 hops of 10 µs + 2*7/8 * 1e9/2e9
    got = plan.allreduce_s(1e9, 8, _cluster(1, algorithm="halving_doubling"), "hierarchical")
    assert got == pytest.approx(6 * 10e-6 + 0.875, rel=1e-12)


def test_one_node_uses_only_the_intra_node_link_and_one_device_nothing():
    assert plan.allreduce_s(1e9, 1, _cluster(4), "ring") == pytest.approx(6e-6 + 0.15, rel=1e-12)
    assert plan.allreduce_s(1e9, 1, _cluster(1), "ring") == 0.0


# --- overlap with the backward pass ---

def _four_ready():  # 4 gradients of 1 byte, ready at 1, 2, 3, 4 s of a 4 s backward pass
    return [(1.0, 1.0), (2.0, 1.0), (3.0, 1.0), (4.0, 1.0)]


def test_unfused_collectives_queue_behind_a_slow_link():
    # 1.5 s each, one per gradient: 1-2.5, 2.5-4, 4-5.5, 5.5-7 -> 3 s after the backward pass.
    # The closed form for evenly ready gradients: max(c, T_comm - T_b (1 - 1/k)) = max(1.5, 6 - 3) = 3.
    got = plan.overlap(_four_ready(), 4.0, lambda b: 1.5, threshold_bytes=1)
    assert (got.collectives, got.busy_s, got.end_s, got.exposed_s) == (4, 6.0, 7.0, 3.0)


def test_what_is_ready_when_the_link_frees_goes_as_one_collective():
    # 0.5 s + 1 s/byte: [1] 1-2.5, [2] 2.5-4, [3,4] 4-6.5 (2.5 s)
    got = plan.overlap(_four_ready(), 4.0, lambda b: 0.5 + b, threshold_bytes=100)
    assert (got.collectives, got.busy_s, got.end_s, got.exposed_s) == (3, 5.5, 6.5, 2.5)


def test_after_the_backward_pass_everything_goes_at_its_end():
    got = plan.overlap(_four_ready(), 4.0, lambda b: 0.5 + b, threshold_bytes=100, after_backward=True)
    assert (got.collectives, got.end_s, got.exposed_s) == (1, 8.5, 4.5)


def test_static_buckets_go_only_when_their_last_gradient_is_ready():
    # buckets of 2 bytes: [1,2] ready at 2 -> 2-4.5, [3,4] ready at 4, link free at 4.5 -> 4.5-7
    got = plan.overlap(_four_ready(), 4.0, lambda b: 0.5 + b, threshold_bytes=2, static=True)
    assert (got.collectives, got.end_s, got.exposed_s) == (2, 7.0, 3.0)


def test_a_collective_starts_only_on_a_cycle_tick():
    # cycle 2 s: the first tick with a gradient ready is 2, when [1,2] are: 2-4.5; the link is free at 4.5,
    # the next tick is 6, when [3,4] are ready: 6-8.5
    got = plan.overlap(_four_ready(), 4.0, lambda b: 0.5 + b, threshold_bytes=100, cycle_s=2.0)
    assert (got.collectives, got.end_s, got.exposed_s) == (2, 8.5, 4.5)


def test_launch_groups_are_fixed_ahead_and_wait_for_no_cycle_tick():
    # Horovod 0.9-0.13 in a TF 1.x graph. Four 1-byte gradients ready at 1, 2, 3, 4 s of a 4 s backward pass;
    # 2 nodes of 1 device: a collective is 2*1*α + 2*1/2 * b / B = 0.5 s + 1 s/byte (α 0.25 s, B 1 byte/s);
    # threshold 2 bytes, cycle 3 s.
    layers = ((1.0, 1.0),) * 4
    cluster = _cluster(1, inter=(1e-9, 0.25e6))

    def exposed(bucketing: str) -> float:
        p = _profile(backward_s=4.0, grad_bytes=4.0, tensors=4, layers=layers, fusion_threshold_bytes=2,
                     cycle_s=3.0, bucketing=bucketing)
        return plan.predict(p, cluster, plan.Scheme("fp32"), 2).exposed_communication_s

    # launch: groups [1,2] and [3,4] fixed ahead; [1,2] when its last is ready, 2-4.5; [3,4] back to back,
    # 4.5-7: 3 s after the backward pass
    assert exposed("launch") == pytest.approx(3.0, rel=1e-9)
    # static: the same groups, each at the next tick: [1,2] ready at 2 -> 3-5.5, [3,4] -> 6-8.5: 4.5 s
    assert exposed("static") == pytest.approx(4.5, rel=1e-9)
    # dynamic: the tick at 3 finds [1,2,3] ready, takes [1,2] (threshold) 3-5.5; tick 6: [3,4] 6-8.5: 4.5 s
    assert exposed("dynamic") == pytest.approx(4.5, rel=1e-9)
    with pytest.raises(ConfigError, match="bucketing must be one of dynamic, static, launch"):
        _profile(bucketing="eager")


def test_a_collective_beside_the_backward_pass_slows_it_and_the_gradients_after_it():
    # σ = 1: the backward pass computes at half speed while a collective runs. 0.5 s + 1 s/byte, fused as ready.
    # [1] ready at 1: 1-2.5. Gradient 2 needs 1 more s of compute: 1-2.5 gives 0.75 of it, so it is ready at
    # 2.75: [2] 2.75-4.25. Gradient 3: 0.25 before 2.75 and 0.75 inside: ready at 4.5: [3] 4.5-6. Gradient 4:
    # the same: 6.25: [4] 6.25-7.75. The pass ends at 6.25 (2.25 s late), the last collective 1.5 s after it.
    got = plan.overlap(_four_ready(), 4.0, lambda b: 0.5 + b, threshold_bytes=100, slowdown=1.0)
    assert (got.collectives, got.busy_s, got.end_s, got.exposed_s, got.stretch_s) == (4, 6.0, 7.75, 1.5, 2.25)
    # σ = 0 is the case above ([1] [2] [3,4], 2.5 s exposed); after the backward pass nothing runs beside it.
    assert plan.overlap(_four_ready(), 4.0, lambda b: 0.5 + b, threshold_bytes=100).stretch_s == 0.0
    after = plan.overlap(_four_ready(), 4.0, lambda b: 0.5 + b, threshold_bytes=100, after_backward=True,
                         slowdown=1.0)
    assert (after.end_s, after.exposed_s, after.stretch_s) == (8.5, 4.5, 0.0)


def test_the_step_pays_the_contention_and_the_table_shows_it():
    # One 8e9 B gradient ready at the end of a 2 s backward pass: nothing runs beside the pass, so σ costs
    # nothing. Two gradients of 4e9 B at 1 and 2 s, 1 GB/s between 2 nodes: [1] 1-5 s; the second half of
    # the pass runs beside it at 1/(1 + 0.5): ready at 2.5, [2] 5-9 s. Step: 3 + 0.5 contention + 6.5
    # exposed + 2 x 0.1 negotiation.
    cluster = _cluster(1, inter=(1.0, 0.0))
    one = plan.predict(_profile(overlap_slowdown=0.5), cluster, plan.Scheme("fp32"), 2)
    assert (one.contention_s, one.step_s) == (0.0, pytest.approx(11.1))
    two = plan.predict(_profile(tensors=2, overlap_slowdown=0.5), cluster, plan.Scheme("fp32"), 2)
    assert (two.contention_s, two.exposed_communication_s) == (pytest.approx(0.5), pytest.approx(6.5))
    assert two.step_s == pytest.approx(3 + 0.5 + 6.5 + 0.2)
    assert two.efficiency == pytest.approx(3 / 10.2)  # against one device's step, which has no collective
    assert "| contention |" in plan.format_table([two]) and "| contention |" not in plan.format_table([one])
    assert plan.Profile.from_dict({"per_replica_batch": 1, "forward_s": 1, "backward_s": 1, "grad_bytes": 1,
                                   "tensors": 1, "overlap_slowdown": 0.25}).overlap_slowdown == 0.25
    with pytest.raises(ConfigError, match="overlap_slowdown"):
        _profile(overlap_slowdown=-0.1)


def test_the_profiles_layers_set_when_each_gradient_is_ready():
    p = _profile(layers=((3.0, 1.0), (5.0, 3.0)), grad_bytes=8.0, tensors=2)  # rescaled to backward_s = 2
    assert p.ready() == [(0.5, 3.0), (2.0, 5.0)]
    assert _profile(tensors=4, grad_bytes=8.0).ready(0.5) == [(0.5, 1.0), (1.0, 1.0), (1.5, 1.0), (2.0, 1.0)]


# --- the step ---

def test_fp32_step_is_compute_plus_the_unhidden_reduction_plus_negotiation():
    # 2 nodes x 1 device, 1 GB/s, no latency: 2*1/2 * 8e9 / 1e9 = 8 s, ready at 2 s -> ends at 10 -> 8 exposed
    r = plan.predict(_profile(), _cluster(1, inter=(1.0, 0.0)), plan.Scheme("fp32"), 2, epochs=1, images=640)
    assert (r.compute_s, r.exposed_communication_s, r.negotiation_s, r.input_stall_s) == (3.0, 8.0, 0.1, 0.0)
    assert r.step_s == pytest.approx(11.1)
    assert r.images_per_sec == pytest.approx(64 / 11.1)
    assert r.efficiency == pytest.approx(3 / 11.1)
    assert r.time_to_train_s == pytest.approx(10 * 11.1)  # 640 images / (2 x 32) = 10 steps


def test_fp16_halves_the_bytes_and_local_sgd_spreads_one_exchange_over_h_steps():
    cluster = _cluster(1, inter=(1.0, 0.0))
    assert plan.predict(_profile(), cluster, plan.Scheme("fp16"), 2).step_s == pytest.approx(3 + 4 + 0.1)
    local = plan.predict(_profile(), cluster, plan.Scheme("local", local_steps=4), 2)
    assert (local.exposed_communication_s, local.negotiation_s) == (2.0, 0.025)
    assert local.step_s == pytest.approx(5.025)


def test_powersgd_sends_its_factors_in_two_rounds_after_the_backward_pass():
    # one 1000 x 1000 gradient at rank 1: P and Q, 4 * (1000 + 1000) bytes; two rounds of 4000 B at 1000 B/s
    p = _profile(grad_bytes=4e6, gradient_shapes=((1000, 1000),))
    r = plan.predict(p, _cluster(1, inter=(1e-6, 0.0)), plan.Scheme("powersgd", rank=1), 2)
    assert (r.exposed_communication_s, r.collectives) == (pytest.approx(8.0), 2)
    assert r.step_s == pytest.approx(3 + 8 + 0.2)
    with pytest.raises(ConfigError, match="gradient_shapes"):
        plan.predict(_profile(), _cluster(1), plan.Scheme("powersgd", rank=1), 2)


def test_fp16_pays_its_reductions_arithmetic_beyond_float32s_on_the_bytes_each_device_sums():
    # 2 nodes x 1 device, 1 GB/s: fp16 sends 4e9 B, 2*1/2 * 4e9 / 1e9 = 4 s on the link; γ = 1 ns/B on the
    # (N-1)/N = 1/2 of them each device sums: + 2 s. Ready at 2 s (one tensor) -> ends at 8: 6 s exposed.
    p = _profile(gamma_s_per_byte={"float16": 1e-9})
    cluster = _cluster(1, inter=(1.0, 0.0))
    r = plan.predict(p, cluster, plan.Scheme("fp16"), 2)
    assert (r.exposed_communication_s, r.step_s) == (pytest.approx(6.0), pytest.approx(3 + 6 + 0.1))
    # float32's arithmetic is in the link's measured rate: γ of float16 does not touch fp32.
    assert plan.predict(p, cluster, plan.Scheme("fp32"), 2).step_s == pytest.approx(11.1)
    # What each device sums: (N-1)/N in a ring; (g-1)/g, then (M-1)/M of its 1/g shard, in two levels.
    assert plan.reduced_share(2, _cluster(4), "ring") == pytest.approx(7 / 8)
    assert plan.reduced_share(2, _cluster(4), "hierarchical") == pytest.approx(3 / 4 + 1 / 2 / 4)
    assert plan.reduced_share(1, _cluster(4), "hierarchical") == pytest.approx(3 / 4)
    assert plan.reduced_share(1, _cluster(1), "ring") == 0.0


def test_a_schemes_codec_runs_in_series_with_the_compute():
    p = _profile(grad_bytes=4e6, gradient_shapes=((1000, 1000),), codec_s={"fp32": 0.5, "powersgd:1": 0.25})
    cluster = _cluster(1, inter=(1.0, 0.0))
    fp32 = plan.predict(p, cluster, plan.Scheme("fp32"), 2)
    # 4e6 B at 1 GB/s: 4 ms, ready at 2 s: 4 ms exposed; + 0.1 negotiation + 0.5 codec
    assert (fp32.codec_s, fp32.step_s) == (0.5, pytest.approx(3 + 0.5 + 0.004 + 0.1))
    local = plan.predict(p, cluster, plan.Scheme("local", local_steps=4), 2)  # fp32's codec, every 4th step
    assert local.codec_s == pytest.approx(0.125)
    assert plan.predict(p, cluster, plan.Scheme("powersgd", rank=1), 2).codec_s == 0.25
    assert plan.predict(p, cluster, plan.Scheme("fp16"), 2).codec_s == 0.0  # not in the profile: 0
    assert plan.predict(p, cluster, plan.Scheme("fp32"), 1).step_s == 3.0  # one device: no reduction, no codec
    with pytest.raises(ConfigError, match=r"codec_s\['fp16'\]"):
        _profile(codec_s={"fp16": -1.0})
    with pytest.raises(ConfigError, match="gamma_s_per_byte"):
        _profile(gamma_s_per_byte=[1e-9])


def _bursty(bandwidth_GBps: float, burst_bytes: float) -> plan.Cluster:
    return plan.Cluster(1, Interconnect("intra", 10.0, 0.0), Interconnect("inter", bandwidth_GBps, 0.0, burst_bytes))


def test_a_links_burst_sends_what_its_bucket_holds_at_once_and_refills_while_the_link_idles():
    # fp32, 2 nodes x 1 device, 1 GB/s: 8e9 B on each link, 8 s, after the backward pass (one tensor).
    # A 2e9 B bucket: it refills in 2 s, and the link idles 3.1 s a step (compute + negotiation): full at
    # every step's start, 2e9 B go at once -> 6 s on the link; step 3 + 6 + 0.1.
    r = plan.predict(_profile(), _bursty(1.0, 2e9), plan.Scheme("fp32"), 2)
    assert (r.communication_s, r.step_s) == (pytest.approx(6.0), pytest.approx(9.1))
    # A 5e9 B bucket refills only 1 GB/s x 3.1 s = 3.1e9 B between steps -> 4.9 s on the link.
    r = plan.predict(_profile(), _bursty(1.0, 5e9), plan.Scheme("fp32"), 2)
    assert (r.communication_s, r.step_s) == (pytest.approx(4.9), pytest.approx(8.0))
    # Local SGD, H = 4: the link idles 4 steps' compute between exchanges (12.1 s): the whole 5e9 B each
    # time -> 3 s per exchange, 0.75 s a step.
    r = plan.predict(_profile(), _bursty(1.0, 5e9), plan.Scheme("local", local_steps=4), 2)
    assert (r.exposed_communication_s, r.step_s) == (pytest.approx(0.75), pytest.approx(3 + 0.75 + 0.025))
    # No burst: the α-β model as before (the fp32 case above: 8 s, step 11.1).
    assert plan.predict(_profile(), _bursty(1.0, 0.0), plan.Scheme("fp32"), 2).step_s == pytest.approx(11.1)


def test_a_steps_collectives_draw_on_the_bucket_in_order():
    # PowerSGD rank 1 on one 1000 x 1000 gradient: two rounds of 4000 B at 1000 B/s, 4 s each (the case
    # above, step 11.2). A 6000 B bucket would send round 1 at once and 2000 B of round 2; but between steps
    # the link idles 3.2 s (compute + 2 negotiations) and refills 3200 B: round 1 takes (4000 - 3200) / 1000
    # = 0.8 s, round 2 the whole 4 s; step 3 + 4.8 + 0.2.
    p = _profile(grad_bytes=4e6, gradient_shapes=((1000, 1000),))
    r = plan.predict(p, _bursty(1e-6, 6000.0), plan.Scheme("powersgd", rank=1), 2)
    assert (r.exposed_communication_s, r.step_s) == (pytest.approx(4.8), pytest.approx(8.0))


def test_the_bucket_belongs_to_the_link_whose_rate_prices_the_bytes():
    # Flat ring over 2 nodes of 4: each device's link carries 2*7/8*b at the slower (inter) link's rate;
    # two levels: 2*3/4*b in the node, 2*1/2*b between nodes; one node: the node's link only.
    assert plan.link_bytes(1e9, 2, _cluster(4), "ring") == [("inter", pytest.approx(1.75e9))]
    assert plan.link_bytes(1e9, 2, _cluster(4), "hierarchical") == [("intra", pytest.approx(1.5e9)),
                                                                    ("inter", pytest.approx(1e9))]
    assert plan.link_bytes(1e9, 1, _cluster(4), "ring") == [("intra", pytest.approx(1.5e9))]
    assert plan.link_bytes(1e9, 1, _cluster(1), "ring") == []
    # A burst on the fast intra link does nothing to a flat ring priced at the inter link's rate.
    fast_burst = plan.Cluster(4, Interconnect("intra", 10.0, 1.0, 1e12), Interconnect("inter", 2.0, 10.0))
    assert plan.predict(_profile(), fast_burst, plan.Scheme("fp32"), 2).step_s == \
        plan.predict(_profile(), _cluster(4), plan.Scheme("fp32"), 2).step_s
    # The description's optional field, and a bad one named.
    c = plan.Cluster.from_dict({"devices_per_node": 1, "intra": "nvlink",
                                "inter": {"bandwidth_GBps": 0.1, "latency_us": 0, "burst_bytes": 131072}})
    assert c.inter.burst_bytes == 131072 and c.intra.burst_bytes == 0.0
    with pytest.raises(ConfigError, match="burst_bytes must be a finite number >= 0"):
        Interconnect("x", 1.0, 0.0, -1.0)


def test_a_slow_input_pipeline_sets_the_step_and_the_baseline():
    # fp16 step 7.1 s; the node needs 32 images at 4 images/s = 8 s: 0.9 s of stall. One device alone is
    # also input-bound (4 < 32/3 images/s), so the efficiency is 1.
    r = plan.predict(_profile(input_images_per_sec=4.0), _cluster(1, inter=(1.0, 0.0)), plan.Scheme("fp16"), 2)
    assert (r.input_stall_s, r.step_s) == (pytest.approx(0.9), pytest.approx(8.0))
    assert r.efficiency == pytest.approx(1.0)


def test_one_device_has_no_reduction():
    r = plan.predict(_profile(), _cluster(1), plan.Scheme("fp32"), 1)
    assert (r.step_s, r.efficiency, r.collectives) == (3.0, 1.0, 0)


# --- inputs and the command ---

def test_schemes_parse_and_bad_ones_say_the_fix():
    assert plan.Scheme.parse("powersgd:4", "hierarchical") == plan.Scheme("powersgd", rank=4, topology="hierarchical")
    assert plan.Scheme.parse("local:16").local_steps == 16
    with pytest.raises(ConfigError, match="powersgd:R"):
        plan.Scheme.parse("int8")
    with pytest.raises(ConfigError, match="topology"):
        plan.Scheme.parse("fp32", "tree")


def test_a_profile_without_a_field_names_it():
    with pytest.raises(ConfigError, match="'backward_s'"):
        plan.Profile.from_dict({"per_replica_batch": 1, "forward_s": 1, "grad_bytes": 1, "tensors": 1})
    with pytest.raises(ConfigError, match="not a preset"):
        plan.Cluster.from_dict({"devices_per_node": 1, "intra": "pcie9", "inter": "ndr"})


def test_the_command_prints_a_table_writes_a_plot_and_imports_no_tensorflow(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"plan_inputs": {"name": "m", "per_replica_batch": 32, "forward_s": 0.01,
                                                   "backward_s": 0.02, "grad_bytes": 1e8, "tensors": 50}}))
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"devices_per_node": 8, "intra": "nvlink", "inter": "ndr"}))
    png = tmp_path / "eff.png"
    code = ("import sys; from hvrep.cli import main; rc = main(sys.argv[1:]); "
            "assert 'tensorflow' not in sys.modules, 'hvrep plan imported TensorFlow'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, "plan", str(profile), "--cluster", str(cluster), "--nodes",
                          "1,4", "--schemes", "fp32,local:8", "--plot", str(png), "--epochs", "1", "--images",
                          "1000"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| fp32") or line.startswith("| local")]
    assert len(rows) == 8, out.stdout  # 2 schemes x 2 topologies x 2 node counts
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "hvrep.cli", "plan", str(profile), "--cluster", str(cluster),
                          "--schemes", "int8"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "int8" in bad.stderr
