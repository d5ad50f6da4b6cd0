"""`hvrep launch`: each launcher's argv from its documented flags, validation, the CLI, one real run each.

Expected command lines are written from the launchers' own documentation
(Horovod's "Horovod with MPI" guide, Open MPI's mpirun(1), Slurm's srun(1)),
not copied from the builders' output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep import cli
from hvrep.cluster.launch import (
    LaunchSpec,
    build_argv,
    format_argv,
    horovodrun_argv,
    mpirun_argv,
    run,
    srun_argv,
    with_mpi4py,
)
from hvrep.errors import ConfigError, SetupError

BIN = Path(sys.executable).parent
TRAIN = ("python", "train.py")


def spec(**kw) -> LaunchSpec:
    return LaunchSpec(**{"np": 4, "command": TRAIN, **kw})


# --- mpirun -------------------------------------------------------------------------------------------------


def test_mpirun_matches_horovods_guide_for_one_machine():
    # Horovod's guide: mpirun -np 4 -bind-to none -map-by slot -x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH -x PATH ...
    env = {"NCCL_DEBUG": "INFO", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64", "PATH": "/usr/bin", "HOME": "/root"}
    assert mpirun_argv(spec(launcher="mpirun"), env) == [
        "mpirun", "-np", "4", "--bind-to", "none", "--map-by", "slot",
        "-x", "LD_LIBRARY_PATH", "-x", "NCCL_DEBUG", "-x", "PATH",
        "python", "-m", "mpi4py", "train.py",
    ]


def test_mpirun_with_hosts_matches_horovods_four_machine_example():
    hosts = ("server1:4", "server2:4", "server3:4", "server4:4")
    argv = mpirun_argv(spec(np=16, hosts=hosts, launcher="mpirun"), {})
    assert argv[:5] == ["mpirun", "-np", "16", "-H", "server1:4,server2:4,server3:4,server4:4"]
    assert argv[5:9] == ["--bind-to", "none", "--map-by", "slot"]


def test_mpirun_forwards_only_the_named_variables():
    env = {
        "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1", "HOROVOD_FUSION_THRESHOLD": "0",
        "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "0,1", "LD_LIBRARY_PATH": "/l", "PATH": "/p",
        "PYTHONPATH": "/src", "VIRTUAL_ENV": "/venv",
        # not forwarded: other names, and names that merely contain a prefix
        "HOME": "/root", "SLURM_JOB_ID": "7", "OMPI_MCA_btl": "tcp", "MY_NCCL_DEBUG": "1", "TF": "x",
        "HOROVODRUN": "x", "CUDA_HOME": "/cuda", "PATHS": "x", "AWS_SECRET_ACCESS_KEY": "s3cr3t",
        # TensorFlow's by name: Terraform's TF_* are not TensorFlow's
        "TF_XLA_FLAGS": "--tf_xla_auto_jit=2", "TF_CLI_CONFIG_FILE": "/home/u/.terraformrc", "TF_VAR_region": "eu",
    }
    argv = mpirun_argv(spec(launcher="mpirun"), env)
    forwarded = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert forwarded == sorted([
        "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "HOROVOD_FUSION_THRESHOLD", "TF_CPP_MIN_LOG_LEVEL",
        "TF_XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "PATH", "PYTHONPATH", "VIRTUAL_ENV",
    ])
    assert not any("=" in name for name in forwarded)  # names only: values stay out of the printed command
    assert "s3cr3t" not in " ".join(argv)


def test_mpirun_forwards_cuda_visible_devices_only_when_set():
    assert "CUDA_VISIBLE_DEVICES" not in mpirun_argv(spec(launcher="mpirun"), {"PATH": "/p"})
    assert "CUDA_VISIBLE_DEVICES" in mpirun_argv(spec(launcher="mpirun"), {"CUDA_VISIBLE_DEVICES": ""})


def test_root_flag_only_when_asked_and_only_for_mpirun():
    assert "--allow-run-as-root" not in mpirun_argv(spec(launcher="mpirun"), {})
    assert "--allow-run-as-root" in mpirun_argv(spec(launcher="mpirun", allow_run_as_root=True), {})
    for launcher in ("horovodrun", "srun"):
        argv = build_argv(spec(launcher=launcher, allow_run_as_root=True), {})
        assert "--allow-run-as-root" not in argv


@pytest.mark.parametrize(("bind", "expected"), [("core", "core"), ("socket", "socket"), ("none", "none")])
def test_mpirun_bind(bind, expected):
    argv = mpirun_argv(spec(launcher="mpirun", bind=bind), {})
    assert argv[argv.index("--bind-to") + 1] == expected
    assert argv[argv.index("--map-by") + 1] == "slot"


def test_mpirun_overcommit_uses_open_mpis_oversubscribe_and_overload_qualifiers():
    argv = mpirun_argv(spec(launcher="mpirun", overcommit=True), {})
    assert argv[argv.index("--map-by") + 1] == "slot:OVERSUBSCRIBE"
    assert argv[argv.index("--bind-to") + 1] == "none"
    argv = mpirun_argv(spec(launcher="mpirun", overcommit=True, bind="core"), {})
    assert argv[argv.index("--bind-to") + 1] == "core:overload-allowed"


def test_extra_arguments_go_just_before_the_command():
    extra = ("--mca", "btl_tcp_if_include", "eth0")
    argv = mpirun_argv(spec(launcher="mpirun", extra=extra), {"PATH": "/p"})
    assert argv[-7:] == [*extra, "python", "-m", "mpi4py", "train.py"]
    assert horovodrun_argv(spec(extra=("--verbose",)))[-3:] == ["--verbose", *TRAIN]
    assert srun_argv(spec(launcher="srun", extra=("--exclusive",)))[-5:] == [
        "--exclusive", "python", "-m", "mpi4py", "train.py"]


# --- python -m mpi4py -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "expected"), [
    (["python", "train.py", "--lr", "0.1"], ["python", "-m", "mpi4py", "train.py", "--lr", "0.1"]),
    (["python3.11", "-u", "train.py"], ["python3.11", "-u", "-m", "mpi4py", "train.py"]),
    (["/venv/bin/python3", "-c", "pass"], ["/venv/bin/python3", "-m", "mpi4py", "-c", "pass"]),
    (["python", "-X", "dev", "-m", "hvrep", "train"], ["python", "-X", "dev", "-m", "mpi4py", "-m", "hvrep", "train"]),
    (["python", "-W", "error", "t.py"], ["python", "-W", "error", "-m", "mpi4py", "t.py"]),
])
def test_python_commands_get_mpi4py(command, expected):
    assert with_mpi4py(command) == expected


@pytest.mark.parametrize("command", [
    ["python", "-m", "mpi4py", "train.py"],  # already there
    ["python", "-u", "-m", "mpi4py.run", "train.py"],
    ["hvrep", "train", "--config", "demo"],  # not Python: left alone
    ["./train.sh"],
    ["python-config", "--cflags"],
    ["python"],  # nothing to run under mpi4py
])
def test_other_commands_are_left_alone(command):
    assert with_mpi4py(command) == command


def test_horovodrun_does_not_wrap_in_mpi4py():
    assert horovodrun_argv(spec())[-2:] == list(TRAIN)


# --- horovodrun -----------------------------------------------------------------------------------------------


def test_horovodrun_defaults_to_localhost_slots_and_gloo():
    # horovodrun's docs: horovodrun -np 4 -H localhost:4 python train.py; --gloo picks the Gloo controller.
    assert horovodrun_argv(spec()) == ["horovodrun", "-np", "4", "-H", "localhost:4", "--gloo", *TRAIN]


def test_horovodrun_with_hosts_and_mpi():
    hosts = ("server1:4", "server2:4")
    assert horovodrun_argv(spec(np=8, hosts=hosts, gloo=False)) == [
        "horovodrun", "-np", "8", "-H", "server1:4,server2:4", "--mpi",
        "--binding-args=--bind-to none --map-by slot", *TRAIN]


def test_horovodrun_mpi_binding_goes_through_binding_args():
    argv = horovodrun_argv(spec(gloo=False, bind="core"))
    assert "--binding-args=--bind-to core --map-by slot" in argv


def test_horovodrun_elastic_names_sizes_and_script_instead_of_hosts():
    # Horovod's elastic guide: horovodrun -np 8 --min-np 4 --max-np 12 --host-discovery-script ./discover_hosts.sh
    assert horovodrun_argv(spec(np=8, min_np=4, max_np=12, host_discovery_script="./discover_hosts.sh")) == [
        "horovodrun", "-np", "8", "--min-np", "4", "--max-np", "12", "--host-discovery-script",
        "./discover_hosts.sh", "--gloo", *TRAIN]


def test_horovodrun_gloo_cannot_bind():
    with pytest.raises(ConfigError, match=r"bind='core'.*horovodrun --gloo.*Fix"):
        spec(bind="core")


# --- srun -----------------------------------------------------------------------------------------------------


def test_srun_uses_pmix_and_no_binding():
    assert srun_argv(spec(launcher="srun")) == [
        "srun", "--mpi=pmix", "-n", "4", "--cpu-bind=none", "python", "-m", "mpi4py", "train.py"]


def test_srun_hosts_become_nodes_nodelist_and_tasks_per_node():
    argv = srun_argv(spec(np=8, hosts=("node1:4", "node2:4"), launcher="srun"))
    assert argv[:4] == ["srun", "--mpi=pmix", "-n", "8"]
    assert {"--nodes=2", "--nodelist=node1,node2", "--ntasks-per-node=4"} <= set(argv)


@pytest.mark.parametrize(("bind", "flag"), [("core", "--cpu-bind=cores"), ("socket", "--cpu-bind=sockets")])
def test_srun_bind(bind, flag):
    assert flag in srun_argv(spec(launcher="srun", bind=bind))


def test_srun_overcommit_only_when_asked():
    assert "--overcommit" not in srun_argv(spec(launcher="srun"))
    assert "--overcommit" in srun_argv(spec(launcher="srun", overcommit=True))


def test_srun_rejects_unequal_slots():
    with pytest.raises(ConfigError, match=r"hosts=a:2,b:4.*different slot counts.*Fix"):
        spec(np=2, hosts=("a:2", "b:4"), launcher="srun")


def test_build_argv_dispatches_on_the_launcher():
    for launcher in ("horovodrun", "mpirun", "srun"):
        assert build_argv(spec(launcher=launcher), {})[0] == launcher


# --- validation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "pattern"), [
    ({"np": 0}, r"np=0 must be an integer >= 1\. Fix"),
    ({"np": True}, r"np=True must be an integer"),
    ({"np": "2"}, r"np='2' must be an integer"),
    ({"launcher": "mpiexec"}, r"launcher='mpiexec' is not one of horovodrun, mpirun, srun\. Fix"),
    ({"bind": "numa"}, r"bind='numa' is not one of none, core, socket\. Fix"),
    ({"command": ()}, r"command=\(\) is empty\. Fix: put the program after --"),
    ({"command": "python train.py"}, r"command='python train.py' must be a sequence of strings.*Fix"),
    ({"hosts": ()}, r"hosts=\(\) is empty\. Fix"),
    ({"hosts": ("node1",)}, r"hosts entry 'node1' is not HOST:SLOTS\. Fix: write it as node1:4"),
    ({"hosts": ("node1:0",)}, r"hosts entry 'node1:0' has slots '0'.*Fix"),
    ({"hosts": ("node1:x",)}, r"hosts entry 'node1:x' has slots 'x'"),
    ({"hosts": ("a:2", "a:2")}, r"hosts lists 'a' twice"),
    ({"np": 9, "hosts": ("a:4", "b:4")}, r"np=9 is more than the 8 slots of hosts=a:4,b:4\. Fix: lower --np to 8"),
    ({"min_np": 2}, r"min_np/max_np apply to horovodrun's elastic driver.*Fix: add --host-discovery-script"),
    ({"host_discovery_script": "d.sh", "launcher": "mpirun"}, r"needs horovodrun's elastic driver over Gloo"),
    ({"host_discovery_script": "d.sh", "hosts": ("a:4",)}, r"hosts and host_discovery_script both name"),
    ({"host_discovery_script": "d.sh", "min_np": 5}, r"--min-np 5 <= --np 4 <= --max-np 4 does not hold"),
])
def test_bad_specs_name_the_field_the_value_and_the_fix(kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        spec(**kw)


def test_config_error_is_a_value_error_and_lists_become_tuples():
    assert issubclass(ConfigError, ValueError)
    s = LaunchSpec(np=2, command=["python", "t.py"], hosts=["a:2"], extra=["-v"])
    assert (s.command, s.hosts, s.extra) == (("python", "t.py"), ("a:2",), ("-v",))
    hash(s)  # frozen and hashable


def test_missing_launcher_is_a_setup_error_with_the_fix(tmp_path):
    # srun is never in the venv; an empty PATH hides the system's.
    with pytest.raises(SetupError, match=r"launcher 'srun' was not found.*Fix: srun comes with Slurm"):
        run(spec(launcher="srun"), environ={"PATH": str(tmp_path)})


# --- the CLI --------------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    """This environment without any launcher's variables, the venv's bin first (as when it is activated)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PRTE_", "SLURM_", "HOROVOD_"))}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def test_cli_dry_run_prints_the_command():
    res = subprocess.run([str(BIN / "hvrep"), "launch", "--np", "2", "--dry-run", "--", "python", "-c", "pass"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "horovodrun -np 2 -H localhost:2 --gloo python -c pass\n"


def test_cli_dry_run_quotes_and_forwards(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    code = cli.main(["launch", "--np", "2", "--launcher", "mpirun", "--allow-run-as-root",
                     "--launcher-args", "--mca btl_tcp_if_include eth0", "--dry-run",
                     "--", "python", "-c", "print('hi there')"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("mpirun -np 2 --bind-to none --map-by slot --allow-run-as-root -x ")
    assert "-x NCCL_DEBUG " in out
    assert out.endswith("--mca btl_tcp_if_include eth0 python -m mpi4py -c 'print('\"'\"'hi there'\"'\"')'\n")


def test_cli_without_double_dash_and_with_hosts(capsys):
    code = cli.main(["launch", "--np", "4", "--hosts", "n1:2, n2:2", "--launcher", "srun", "--overcommit",
                     "--dry-run", "python", "train.py", "--np", "3"])
    assert code == 0
    assert capsys.readouterr().out == (
        "srun --mpi=pmix -n 4 --nodes=2 --nodelist=n1,n2 --ntasks-per-node=2 --cpu-bind=none --overcommit "
        "python -m mpi4py train.py --np 3\n")


def test_cli_reports_a_bad_spec_and_exits_2(capsys):
    assert cli.main(["launch", "--np", "3", "--hosts", "n1:2", "--dry-run", "--", "python", "t.py"]) == 2
    assert "hvrep: error: np=3 is more than the 2 slots of hosts=n1:2" in capsys.readouterr().err


def test_an_elastic_launch_of_hvrep_train_is_checked_before_the_driver_starts(tmp_path):
    # The real CLI: hvrep's error is the last line and nothing starts (no horovodrun traceback after it), for
    # a global batch that a world size does not divide and for sizes the command does not repeat.
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    launch = [str(BIN / "hvrep"), "launch", "--np", "2", "--min-np", "2", "--max-np", "4",
              "--host-discovery-script", str(script), "--"]
    cases = {("hvrep", "train", "--config", "demo", "elastic.min_np=2", "elastic.max_np=4"):
             "train.global_batch=64 does not divide by world size(s) [3] of elastic.min_np=2..elastic.max_np=4",
             ("python", "-m", "hvrep.cli", "train", "--config=demo", "train.global_batch=48"):
             "Fix: add elastic.min_np=2 elastic.max_np=4 to the command."}
    for command, expected in cases.items():
        res = subprocess.run([*launch, *command], capture_output=True, text=True, env=_env(), timeout=120)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("hvrep: error: "), res.stderr[-3000:]
        assert expected in lines[0], lines[0]


def test_format_argv_reads_this_environment(monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "1")
    assert "-x HOROVOD_CYCLE_TIME" in format_argv(spec(launcher="mpirun"))


# --- real launches (2 ranks on this machine) ------------------------------------------------------------------


@pytest.mark.multirank
def test_real_mpirun_launch_starts_two_ranks():
    cmd = [str(BIN / "hvrep"), "launch", "--np", "2", "--launcher", "mpirun", "--allow-run-as-root", "--",
           "python", "-c", "from mpi4py import MPI; print(MPI.COMM_WORLD.size)"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["2", "2"], res.stdout + res.stderr


@pytest.mark.multirank
@pytest.mark.parametrize(("controller", "rank_variable"), [
    ("--gloo", "HOROVOD_RANK"),
    # Without --binding-args, Horovod 0.28.1's horovodrun hands Open MPI 5's mpirun `-bind-to none`, which it
    # rejects ("Executable: none"): this case failed before hvrep passed the double-dash form.
    ("--no-gloo", "OMPI_COMM_WORLD_RANK"),
], ids=["gloo", "mpi-on-open-mpi-5"])
def test_real_horovodrun_launch_starts_two_ranks(controller, rank_variable):
    cmd = [str(BIN / "hvrep"), "launch", "--np", "2", "--launcher", "horovodrun", controller, "--",
           "python", "-c", f"import os; print('rank', os.environ['{rank_variable}'])"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    # horovodrun prefixes each line with "[rank]<stdout>:".
    ranks = sorted(line.rsplit("rank ", 1)[1] for line in res.stdout.splitlines() if "rank " in line)
    assert ranks == ["0", "1"], res.stdout + res.stderr
