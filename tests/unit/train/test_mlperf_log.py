"""`hvrep train train.mllog=<file>`: the MLPerf Training log of a real demo run, checked by MLPerf's own compliance
checker, and every logged hyperparameter against what the run trained with (docs/mlperf.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep.data import num_examples
from hvrep.errors import ConfigError
from hvrep.train import config as configs
from hvrep.train import mlperf
from tests.unit.train.test_train_cli import _env, _events, _train

DOCS = Path(__file__).parents[3] / "docs" / "mlperf.md"
# 2 epochs, warmup over half of the first: the log has a warmup ending mid-epoch and a decay over an epoch
# boundary; LR at every step in metrics.jsonl. The checker asks for no length (docs/mlperf.md).
SHORT = ["--config", "demo", "train.epochs=2", "optim.warmup_epochs=0.5", "train.log_every=1"]


def mllog_records(path: Path) -> list[dict]:
    """The ``:::MLLOG`` lines of a log, decoded."""
    lines = path.read_text().splitlines()
    assert lines and all(line.startswith(":::MLLOG ") for line in lines), lines[:3]
    return [json.loads(line[len(":::MLLOG "):]) for line in lines]


def check_one_attempt(path: Path, status: str) -> list[dict]:
    """One attempt's log, written once (by one rank): one init, one run, its status."""
    records = mllog_records(path)
    keys = [r["key"] for r in records]
    for key in ("cache_clear", "init_start", "init_stop", "run_start", "run_stop", "submission_division",
                "global_batch_size", "opt_name"):
        assert keys.count(key) == 1, (path, key, keys)
    assert keys.index("init_stop") < keys.index("run_start") < keys.index("epoch_start") < keys.index("run_stop")
    assert records[keys.index("run_stop")]["metadata"]["status"] == status, path
    return records


def _checker(log: Path, cwd: Path) -> subprocess.CompletedProcess:
    """MLPerf's checker, exactly as docs/mlperf.md runs it (it writes compliance_checker.log in the cwd)."""
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                           "--ruleset", "4.0.0", str(log)], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def demo_run(demo_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mllog") / "run"
    res = _train([*SHORT, f"data.data_dir={demo_data}", f"output_dir={out}", f"train.mllog={out}/mlperf.log"])
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_mllog_settings_are_validated_and_off_by_default():
    t = configs.build("demo").train
    assert (t.mllog, t.mllog_division, t.mllog_status, t.mllog_cache_clear) == (None, "open", "research", False)
    assert configs.build("demo", ["train.mllog=a.log", "train.mllog_division=closed"]).train.mllog_division == "closed"
    with pytest.raises(ConfigError, match=r"train\.mllog_division must be one of \('open', 'closed'\), got 'Open'"):
        configs.build("demo", ["train.mllog_division=Open"])
    with pytest.raises(ConfigError, match=r"train\.mllog must be a file path or none, got ''"):
        configs.build("demo", ["train.mllog="])
    with pytest.raises(ConfigError, match=r"train\.mllog_status must be one of .*got 'lab'"):
        configs.build("demo", ["train.mllog_status=lab"])


def test_an_existing_log_is_refused_and_a_resumed_attempt_takes_the_next_name(tmp_path):
    log = tmp_path / "out" / "mlperf.log"
    cfg = configs.build("demo", [f"train.mllog={log}", f"output_dir={tmp_path / 'out'}"])
    assert mlperf.log_path(cfg, resume=False, overwrite=False) == log
    log.parent.mkdir()
    log.write_text("")
    with pytest.raises(ConfigError, match=r"train\.mllog=.*mlperf\.log exists: an MLPerf log holds one run.*"
                                          r"--resume .*mlperf\.2\.log"):
        mlperf.log_path(cfg, resume=False, overwrite=False)
    assert mlperf.log_path(cfg, resume=True, overwrite=False) == tmp_path / "out" / "mlperf.2.log"
    (tmp_path / "out" / "mlperf.2.log").write_text("")
    assert mlperf.log_path(cfg, resume=True, overwrite=False) == tmp_path / "out" / "mlperf.3.log"
    # --overwrite moves output_dir aside, the log inside it too; a log elsewhere stays in the way.
    assert mlperf.log_path(cfg, resume=False, overwrite=True) == log
    elsewhere = configs.build("demo", [f"train.mllog={log}", f"output_dir={tmp_path / 'other'}"])
    with pytest.raises(ConfigError, match="exists"):
        mlperf.log_path(elsewhere, resume=False, overwrite=True)
    # The CLI says so before TensorFlow starts (exit 2).
    res = subprocess.run([str(Path(sys.executable).parent / "hvrep"), "train", "--config", "demo",
                          f"train.mllog={log}", f"output_dir={tmp_path / 'new'}"], capture_output=True, text=True,
                         env=_env(), timeout=60)
    assert res.returncode == 2 and "exists: an MLPerf log holds one run" in res.stderr, res.stderr[-2000:]


def test_the_log_of_a_demo_run_passes_mlperfs_compliance_checker_in_the_open_division(demo_run, tmp_path):
    check_one_attempt(demo_run / "mlperf.log", "success")
    res = _checker(demo_run / "mlperf.log", tmp_path)
    assert res.returncode == 0 and "SUCCESS" in res.stdout + res.stderr, res.stdout + res.stderr[-5000:]


def _documented_closed_failures() -> set[str]:
    """The keys of the table under docs/mlperf.md's "closed division" heading."""
    text = DOCS.read_text()
    section = re.search(r"^## [^\n]*[Cc]losed division[^\n]*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"{DOCS} has no '## ... closed division' section"
    return set(re.findall(r"^\| `(\w+)`", section.group(1), re.M))


def test_in_the_closed_division_only_the_checks_the_docs_list_fail(demo_run, tmp_path):
    # train.mllog_division=closed changes this one line (test_the_division_setting_reaches_the_log).
    log = tmp_path / "closed.log"
    text = (demo_run / "mlperf.log").read_text()
    closed = text.replace('"key": "submission_division", "value": "open"',
                          '"key": "submission_division", "value": "closed"')
    assert closed != text
    log.write_text(closed)
    res = _checker(log, tmp_path)
    output = res.stdout + res.stderr
    assert res.returncode == 1 and "FAILED" in output, output[-5000:]
    failed = set(re.findall(r"CHECK for '(\w+)' failed", output)) | set(re.findall(r"Failed checks for (\w+) :",
                                                                                   output))
    # Anything else the checker says (a missing or repeated key) is a failure the docs do not list.
    others = [m for m in re.split(r"-{30}", output) if "Required" in m]
    assert not others, others
    assert failed == _documented_closed_failures(), (failed, output[-5000:])


def test_every_logged_hyperparameter_equals_the_value_trained_with(demo_run, demo_data):
    logged = {r["key"]: r["value"] for r in mllog_records(demo_run / "mlperf.log")
              if r["event_type"] == "POINT_IN_TIME"}
    events = _events(demo_run)
    config = next(e for e in events if e["event"] == "config")
    cfg, opt = config["config"], config["optimizer_config"]  # the RunConfig and the optimizer object of the run
    data = configs.build("demo", [f"data.data_dir={demo_data}"]).data
    n_train, n_val = num_examples(data, "train"), num_examples(data, "val")
    batch = cfg["train"]["global_batch"] * cfg["comm"]["accumulation_steps"]
    spe, epochs = config["steps_per_epoch"], config["epochs"]
    assert (config["optimizer"], cfg["optim"]["optimizer"]) == ("LARS", "lars")
    expected = {
        "global_batch_size": batch, "train_samples": n_train, "eval_samples": n_val,
        "gradient_accumulation_steps": cfg["comm"]["accumulation_steps"], "seed": cfg["train"]["seed"],
        "model_bn_span": cfg["train"]["global_batch"] // config["replicas"], "opt_name": "lars",
        "lars_opt_momentum": cfg["optim"]["momentum"], "lars_opt_weight_decay": cfg["optim"]["weight_decay"],
        "lars_epsilon": opt["epsilon"], "opt_learning_rate_warmup_start_lr": 0.0,
    }
    assert (opt["momentum"], opt["weight_decay"]) == (cfg["optim"]["momentum"], cfg["optim"]["weight_decay"])
    for key, value in expected.items():
        assert logged[key] == value, (key, logged[key], value)

    # The schedule's keys: each step's LR as the optimizer reported it (metrics.jsonl's train events, every step,
    # read from optimizer.learning_rate: the next step's) against hvrep's rule (hvrep/schedules.py) with the logged
    # values: linear warmup, then end + (base - end) * (1 - progress) ** power, over samples trained. The last
    # step of an epoch is left out: the next epoch re-anchors the schedule before its first step (position.py).
    base, end, power = (logged[f"lars_opt_{k}"] for k in ("base_learning_rate", "end_learning_rate",
                                                         "learning_rate_decay_poly_power"))
    warmup, total = logged["lars_opt_learning_rate_warmup_epochs"] * n_train, epochs * n_train
    assert cfg["optim"]["peak_lr"] == base and cfg["optim"]["warmup_epochs"] == pytest.approx(
        logged["lars_opt_learning_rate_warmup_epochs"], abs=1 / n_train)

    def lr(samples: float) -> float:
        if samples < warmup:
            return base * samples / warmup
        return end + (base - end) * (1 - (samples - warmup) / (total - warmup)) ** power

    trains = {e["step"]: e["lr"] for e in events if e["event"] == "train"}
    steps = next(e for e in reversed(events) if e["event"] == "final")["step"]
    assert sorted(trains) == list(range(1, steps + 1)) and steps == epochs * spe
    checked = 0
    for step, reported in trains.items():
        epoch, k = divmod(step, spe)  # the next step: number k of epoch `epoch`
        if k:
            assert reported == pytest.approx(lr(epoch * n_train + k * batch), rel=1e-5), (step, reported)
            checked += 1
    assert checked == steps - epochs
    # Decay steps: the steps trained after the warmup's end (step k of epoch e trains from e * N + k * B samples).
    after_warmup = sum(1 for s in range(steps) if (s // spe) * n_train + (s % spe) * batch >= warmup)
    assert logged["lars_opt_learning_rate_decay_steps"] == after_warmup
    # Accuracy: what each evaluation measured.
    evals = {r["metadata"]["epoch_num"]: r["value"] for r in mllog_records(demo_run / "mlperf.log")
             if r["key"] == "eval_accuracy"}
    assert evals == {e["epoch"]: e["top1"] for e in events if e["event"] == "epoch" and "top1" in e}
    # Every value the log states is one of those checked here.
    stated = set(logged) - {"cache_clear", "eval_accuracy"} - {k for k in logged if k.startswith("submission_")}
    assert stated == set(expected) | {f"lars_opt_{k}" for k in (
        "base_learning_rate", "end_learning_rate", "learning_rate_decay_poly_power", "learning_rate_warmup_epochs",
        "learning_rate_decay_steps")}, stated


def test_the_division_and_submission_settings_reach_the_log(tmp_path):
    # The log's start-up lines, written as the run's chief writes them (no training needed for these).
    cfg = configs.build("demo", ["train.mllog_division=closed", "train.mllog_org=Lab", "train.mllog_status=onprem",
                                 "train.mllog_cache_clear=true", f"train.mllog={tmp_path / 'a.log'}"])
    (log,) = mlperf.listeners(cfg, chief=True, resume=False, overwrite=False, started=1.5)
    assert mlperf.listeners(cfg, chief=False, resume=False, overwrite=False, started=1.5) == []
    log.close()
    got = {r["key"]: r for r in mllog_records(tmp_path / "a.log")}
    assert {k: got[k]["value"] for k in ("submission_division", "submission_org", "submission_status",
                                         "cache_clear", "submission_benchmark")} == {
        "submission_division": "closed", "submission_org": "Lab", "submission_status": "onprem",
        "cache_clear": True, "submission_benchmark": "resnet"}
    assert got["init_start"]["time_ms"] == 1500



def _closed_rules(optimizer: str) -> dict[str, str | None]:
    """Ruleset 4.0.0's closed ResNet rules for ``optimizer`` ("lars", "sgd"), from the installed checker's files:
    key -> its CHECK expression (None: only required)."""
    import yaml
    from mlperf_logging import compliance_checker

    rules = Path(compliance_checker.__file__).parent / "training_3.1.0" / f"closed_resnet_{optimizer}.yaml"
    return {r["KEY"]["NAME"]: r["KEY"].get("CHECK") for r in yaml.safe_load(rules.read_text())}


@pytest.mark.parametrize(("global_batch", "name"), [(4096, "sgd"), (32768, "lars")])
def test_the_recipes_optimizers_log_the_keys_the_closed_rules_require(global_batch, name):
    # What docs/mlperf.md says of optim.optimizer=recipe: above 8,192 (LARS) every closed LARS rule holds; up to
    # 8,192 (Goyal's momentum SGD, step decay) the polynomial decay's power is missing and the end LR is not 1e-4.
    import math

    from mlperf_logging.compliance_checker.mlp_compliance import is_integer

    from hvrep import recipes

    r = recipes.imagenet_resnet50(global_batch)
    logged = mlperf.hyperparameters(type(r.optimizer).__name__, r.optimizer.get_config(), r.epochs,
                                    r.steps_per_epoch, 1)
    logged["model_bn_span"] = 32  # logged by MLPerfLog from the replicas, not by hyperparameters()
    assert logged["opt_name"] == name
    rules = _closed_rules(name)
    missing = set(rules) - set(logged)
    assert missing == ({"sgd_opt_learning_rate_decay_poly_power"} if name == "sgd" else set()), missing
    failed = [key for key, check in rules.items() if key in logged and check and not eval(
        check.strip(), {"is_integer": is_integer, "math": math}, {"v": {"value": logged[key]}})]
    assert failed == (["sgd_opt_end_learning_rate"] if name == "sgd" else []), failed
