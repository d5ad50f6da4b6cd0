"""The run's folders, checked before TensorFlow starts: where the data is and whether ``output_dir`` is free.

``hvrep train`` refuses an ``output_dir`` that holds checkpoints unless it is told what to do with them:
``--resume`` continues the run, ``--overwrite`` starts over after moving the old run aside to
``<output_dir>.old-<UTC time>`` (nothing is deleted; remove the old folder when it is not needed). Without
either, a forgotten ``--resume`` after a preemption would start over among the old run's checkpoints (and, by
``checkpoint.keep``, in place of them) and mix both runs in ``metrics.jsonl``.

Under horovodrun's elastic driver a worker that joins the running job later finds the job's own checkpoints
there: the chief records the job (:data:`ELASTIC_JOB_FILE`, its driver's rendezvous address) when it starts,
and a worker of the same job passes; the job's state then comes from rank 0, not from the folder.
"""

from __future__ import annotations

import time
from pathlib import Path

from hvrep import _env
from hvrep.data.config import DataConfig
from hvrep.errors import ConfigError

_SHARD_PREFIXES = ("train-", "validation-")
ELASTIC_JOB_FILE = "elastic-job"  # in output_dir: the elastic job training there (see the module docstring)
_JPEG = (".jpeg", ".jpg")


def check_data_dir(data: DataConfig) -> None:
    """Raises ConfigError when ``data.data_dir`` is unset, missing, or a JPEG folder read as TFRecords."""
    if not data.data_dir:
        raise ConfigError("data.data_dir is empty. Fix: pass data.data_dir=/path/to/imagenet (a JPEG folder with "
                          "data.format=folder, or the TFRecord shards of `hvrep data prepare`).")
    root = Path(data.data_dir)
    if root.parent == _env.cache_dir() / "demo-data" and not root.exists():
        return  # the demo's data: written by the chief on first use
    if not root.is_dir():
        raise ConfigError(f"data.data_dir={data.data_dir} is not a folder. Fix: pass the folder holding the "
                          "train/ and val/ JPEG folders (data.format=folder) or the TFRecord shards.")
    if data.format == "tfrecord" and not any(p.name.startswith(_SHARD_PREFIXES) for p in root.iterdir()):
        _check_not_jpegs(data.data_dir, root)


def _holds_jpegs(folder: Path) -> bool:
    return any(f.suffix.lower() in _JPEG and f.is_file() for f in folder.iterdir())


def _check_not_jpegs(data_dir: str, root: Path) -> None:
    """Refuses JPEGs read as TFRecords (data.format=tfrecord), pointing at data.format=folder and its layout."""
    why = "but data.format=tfrecord reads TFRecord shards. Fix: "
    split = next((root / s for s in ("train", "val", "validation") if (root / s).is_dir()), None)
    if split is not None and any(_holds_jpegs(c) for c in split.iterdir() if c.is_dir()):
        raise ConfigError(
            f"data.data_dir={data_dir} holds JPEG folders ({split.name}/<class>/*.JPEG), {why}add data.format=folder"
            f" to read the JPEGs as they are, or convert them once with `hvrep data prepare {data_dir} DST` and "
            "pass data.data_dir=DST.")
    if any(_holds_jpegs(c) for c in root.iterdir() if c.is_dir()):  # class folders: one split's folder
        if root.name in ("train", "val", "validation"):
            raise ConfigError(
                f"data.data_dir={data_dir} is the {root.name}/ split of a JPEG folder ({root.name}/<class>/*.JPEG), "
                f"{why}data.data_dir={root.parent} data.format=folder (the folder that holds train/ and val/).")
        raise ConfigError(
            f"data.data_dir={data_dir} holds class folders of JPEGs (<class>/*.JPEG), {why}data.format=folder, "
            f"with the classes moved to {data_dir}/train/<class>/ and {data_dir}/val/<class>/ (the layout it reads).")
    if _holds_jpegs(root):
        raise ConfigError(
            f"data.data_dir={data_dir} holds JPEGs, {why}data.format=folder, with the images in one folder per class "
            f"under {data_dir}/train/ and {data_dir}/val/ (the layout it reads; a class folder's name is the label).")


def holds_checkpoints(output_dir: str | Path) -> bool:
    folder = Path(output_dir) / "checkpoints"
    return folder.is_dir() and any(p.name.startswith("ckpt-") for p in folder.iterdir())


def check_output_dir(output_dir: str | Path, resume: bool, overwrite: bool) -> None:
    """Raises ConfigError when ``output_dir`` holds a run and neither ``resume`` nor ``overwrite`` says what to do."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other. Fix: --resume to continue the run in "
                          f"{output_dir}, or --overwrite to start over (the old run is moved aside).")
    if not resume and not overwrite and holds_checkpoints(output_dir) and not joins_running_job(output_dir):
        raise ConfigError(
            f"output_dir={output_dir} holds checkpoints of an earlier run. Fix: --resume to continue it, "
            f"--overwrite to start over (the old run is moved to {output_dir}.old-<time>), or another output_dir.")


def joins_running_job(output_dir: str | Path) -> bool:
    """This process is a worker of the elastic job that :func:`mark_elastic_job` recorded in ``output_dir``: one
    joining it after it started (its checkpoints are the job's own)."""
    job = _env.elastic_job()
    marker = Path(output_dir) / ELASTIC_JOB_FILE
    return job is not None and marker.is_file() and marker.read_text().strip() == job


def mark_elastic_job(output_dir: str | Path) -> None:
    """Records in ``output_dir`` the elastic job that trains there (the chief, at its start; atomically)."""
    job = _env.elastic_job()
    if job is None:
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{ELASTIC_JOB_FILE}.tmp"
    tmp.write_text(job + "\n")
    tmp.replace(out / ELASTIC_JOB_FILE)


def move_aside(output_dir: str | Path) -> Path | None:
    """Renames ``output_dir`` to ``<output_dir>.old-<UTC time>`` (``--overwrite``, the chief); None if absent."""
    out = Path(output_dir)
    if not out.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = out.with_name(f"{out.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = out.with_name(f"{out.name}.old-{stamp}-{n}")
    out.rename(target)
    return target
