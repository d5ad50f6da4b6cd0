"""hvrep.cluster.netbed without root: names, addresses, the launcher environment, validation.

The bed itself (namespaces, links, launches across them) is tested as root in tests/multihost/.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from hvrep.cluster import netbed
from hvrep.errors import ConfigError, SetupError


def test_names_are_unique_per_bed_and_carry_the_owner_pid():
    a, b = netbed.NetBed(hosts=3), netbed.NetBed(hosts=3)
    assert a.prefix != b.prefix
    assert a.prefix.startswith(f"hvbed-{os.getpid()}-")
    assert a.hosts == ("h1", "h2", "h3")
    assert a.namespace("h2") == f"{a.prefix}-h2" and a.switch_namespace == f"{a.prefix}-sw"
    assert [a.address(h) for h in a.hosts] == ["10.201.0.1", "10.201.0.2", "10.201.0.3"]
    with pytest.raises(ConfigError, match="h4"):
        a.namespace("h4")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"hosts": 0}, "hosts=0"), ({"hosts": 17}, "hosts=17"), ({"hosts": True}, "hosts=True"),
    ({"link_gbit": 0}, "link_gbit=0"), ({"link_gbit": -1.0}, "link_gbit=-1.0"), ({"link_gbit": "1"}, "link_gbit='1'"),
])
def test_bad_arguments_are_refused_with_the_value(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        netbed.NetBed(**kwargs)


def test_env_puts_the_ssh_stand_in_first_and_every_transport_on_the_bed_interface(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bed = netbed.NetBed(hosts=2)
    with pytest.raises(SetupError, match="not up"):
        bed.env()  # no folder, no stand-in yet
    bed._make_dir()  # what up() does first; the rest (namespaces) needs root
    env = bed.env({"PATH": "/usr/bin", "KEEP": "1"})
    assert env["PATH"] == f"{bed.bin_dir}{os.pathsep}/usr/bin" and env["KEEP"] == "1"
    assert env["PRTE_MCA_plm_ssh_agent"] == str(bed.ssh)
    for name in ("HOROVOD_GLOO_IFACE", "OMPI_MCA_btl_tcp_if_include", "PRTE_MCA_oob_tcp_if_include"):
        assert env[name] == netbed.IFACE
    assert env["OMPI_MCA_pml"] == "ob1" and env["OMPI_MCA_btl"] == "self,sm,tcp"


def test_argv_on_enters_the_namespace_and_sets_the_host_name():
    bed = netbed.NetBed(hosts=2)
    argv = bed.argv_on("h2", ["python", "-c", "pass"])
    assert argv[:4] == ["ip", "netns", "exec", bed.namespace("h2")]
    assert "--uts" in argv and argv[-4:] == ["h2", "python", "-c", "pass"]
    with pytest.raises(ConfigError, match="empty"):
        bed.argv_on("h1", [])


def test_tbf_bucket_is_one_millisecond_of_traffic_but_well_above_a_gso_segment():
    assert netbed.tbf_burst_bytes(0.1) == netbed.tbf_burst_bytes(0.5) == 128 * 1024
    assert netbed.tbf_burst_bytes(10.0) == 1_250_000


def test_link_counters_subtract():
    assert netbed.LinkCounters(10, 7) - netbed.LinkCounters(4, 2) == netbed.LinkCounters(6, 5)


def test_the_beds_folder_is_private_and_fresh_even_where_its_old_predictable_name_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bed = netbed.NetBed(hosts=2)
    planted = tmp_path / bed.prefix / "bin"
    planted.mkdir(parents=True)
    (planted / "ssh").write_text("planted")
    bed._make_dir()
    bed._write_ssh()
    assert bed.dir is not None and bed.dir.parent == tmp_path and bed.dir.name.startswith(f"{bed.prefix}-")
    assert bed.dir.stat().st_mode & 0o777 == 0o700 and bed.bin_dir.stat().st_mode & 0o777 == 0o700
    assert (planted / "ssh").read_text() == "planted" and bed.ssh.read_text().startswith("#!/bin/bash")
    assert netbed._folders(bed.prefix) == [bed.dir]  # what teardown removes: the bed's own folder only
