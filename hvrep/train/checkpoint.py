"""Atomic checkpoints in a shared directory: the chief writes, every rank can restore.

Layout of ``directory`` (one writer, the chief, per directory):

    ckpt-00001000/                  a complete checkpoint; the name only ever appears by a rename
        ckpt.index                  tf.train.Checkpoint files (prefix "ckpt")
        ckpt.data-00000-of-00001
        checkpoint.json             {"step": 1000, "time": <Unix s>, "sequence": <save order>, **metadata}
    .tmp-ckpt-1000-<pid>/           being written, or left by a killed run: ignored, removed by the next save
    .replaced-ckpt-1000-<pid>/      the previous ckpt-00001000 while step 1000 is saved again
    .deleting-<name>-<hex>/         being deleted: ignored, removed by the next save

Each checkpoint is written into a temporary folder, fsynced, then renamed to
its final name with ``os.replace``, so a folder under a final name is always
complete and a crash at any point leaves the previous checkpoints readable.
Checkpoints are ordered by save order (``sequence``), not by step: after
restoring an older checkpoint and training on, the new saves are the newest
and the abandoned ones are pruned first.

A checkpoint damaged after it was published (a truncated or bit-flipped data
file: a disk or file-system fault, or a copy cut short) is found by reading
every value back, as a restore does, checksums included (:func:`damage`);
``restore()`` and ``hvrep train --resume`` then fall back to the newest intact
checkpoint, naming the one they skipped and why. ``keep`` >= 2 (the default is
3) leaves one to fall back to.
"""

from __future__ import annotations

import errno
import json
import numbers
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tensorflow as tf

from hvrep.errors import CheckpointError, ConfigError
from hvrep.train import faultpoint

METADATA_FILE = "checkpoint.json"
_PREFIX = "ckpt"  # tf.train.Checkpoint file prefix inside each folder
_RESERVED = ("step", "time", "sequence")  # checkpoint.json keys the manager writes itself
_FINAL = re.compile(r"ckpt-(\d{8,})")
_REPLACED = re.compile(r"\.replaced-ckpt-(\d+)-\d+")
_GARBAGE = (".tmp-ckpt-", ".deleting-")


def _folder_name(step: int) -> str:
    return f"ckpt-{step:08d}"


def _load(folder: Path) -> dict[str, Any] | None:
    """The folder's checkpoint.json, or None if the folder is not a complete checkpoint."""
    if not (folder / f"{_PREFIX}.index").is_file():
        return None
    try:
        record = json.loads((folder / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("sequence"), int) else None


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The ``checkpoint.json`` of a checkpoint folder.

    Returns:
      ``{"step": int, "time": Unix seconds, "sequence": save order, **metadata}``
      where ``metadata`` is what was passed to ``CheckpointManager.save``.

    Raises:
      hvrep.errors.CheckpointError: the file is missing or is not a JSON object.
    """
    file = Path(path) / METADATA_FILE
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"Could not read {file}: {err}. Fix: pass a checkpoint folder returned by "
            "CheckpointManager.latest() or .all()."
        ) from err
    if not isinstance(record, dict):
        raise CheckpointError(f"{file} holds {type(record).__name__}, not a JSON object; it was not written by hvrep.")
    return record


def damage(folder: str | os.PathLike) -> str | None:
    """Why the checkpoint in ``folder`` cannot be read back, or None when every value it holds reads whole.

    Reads each saved value once (one at a time: memory for the largest only), which checks the data file's
    length and TensorFlow's checksum of each value: the reads a restore would make, without restoring.
    """
    prefix = str(Path(folder) / _PREFIX)
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in sorted(reader.get_variable_to_shape_map()):
            reader.get_tensor(name)
    # A truncated data file raises IndexError ("Read less bytes than requested"), a flipped bit an OpError
    # ("Checksum does not match"), a missing file NotFoundError (TF 2.21).
    except (tf.errors.OpError, IndexError, ValueError) as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"{type(err).__name__}: {text[:300]}"
    return None


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        # Some filesystems (NFS, FUSE mounts) cannot fsync a directory; the rename is still atomic there.
        if not directory or err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def skipped_message(folder: Path, why: str, instead: Path | None) -> str:
    """The warning for a damaged checkpoint a resume skips."""
    then = f"resuming from {instead.name}, the newest intact one" if instead else "no older one is intact"
    return f"skipped checkpoint {folder} (it cannot be read back: {why}); {then}."


def all_damaged_message(directory: Path, skipped: list[tuple[Path, str]]) -> str:
    """The error when every checkpoint in ``directory`` is damaged."""
    listed = "; ".join(f"{folder.name}: {why}" for folder, why in skipped)
    return (f"every checkpoint in {directory} is damaged ({listed}). Fix: put back an intact copy of one, or "
            "start afresh with --overwrite (the damaged run is moved aside) or another output_dir.")


class CheckpointManager:
    """Saves and restores ``tf.train.Checkpoint(**trackables)`` in ``directory``.

    Call ``save`` on every rank (only the chief writes) and ``restore`` on
    every rank before training, so all ranks resume from the same folder.

    Optimizer slots: Keras 3 optimizers may be restored before or after they are
    built. Slots that do not exist yet (momentum, Adam moments) are restored by
    TensorFlow when the optimizer creates them on its first ``build`` or
    ``apply_gradients``, also inside ``tf.function`` and a distribution strategy
    (checked with TF 2.21 / Keras 3.15: SGD, Adam, LossScaleOptimizer, LARS). Slots
    are matched by creation order, so build over the same variables in the same
    order as the run that saved.

    Args:
      directory: a local or shared POSIX path every rank can read (created on the
        first save).
      is_chief: True in exactly one process (``Replicator.is_chief``).
      keep: how many checkpoints to keep (>= 1); older ones are deleted after
        a new one is complete.
      **trackables: what to save, e.g. ``model=``, ``optimizer=`` (a Keras
        optimizer; pass ``wrapped.inner`` for ``Replicator.wrap_optimizer``'s
        wrapper), ``step=``, ``epoch=``, ``position=`` (``tf.Variable``s).

    Raises:
      hvrep.errors.ConfigError: ``keep`` < 1, a URL directory, nothing to save, or
        a value ``tf.train.Checkpoint`` cannot track.
    """

    def __init__(self, directory: str | os.PathLike, *, is_chief: bool, keep: int = 3, **trackables: Any) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(
                f"keep must be an int >= 1 (checkpoints kept), got {keep!r}. Fix: keep=1 keeps the newest only.")
        if "://" in os.fspath(directory):
            raise ConfigError(
                f"directory must be a local or shared POSIX path, got {os.fspath(directory)!r}: checkpoints are "
                "made atomic by os.replace. Fix: mount the bucket (e.g. gcsfuse) and pass the mount point."
            )
        if not trackables:
            raise ConfigError(
                "CheckpointManager got nothing to save. Fix: pass what to save as keywords, e.g. "
                "CheckpointManager(directory, is_chief=..., model=model, optimizer=optimizer, step=step)."
            )
        try:
            self._checkpoint = tf.train.Checkpoint(**trackables)
        except ValueError as err:
            wrapped = [f"{k}={k}.inner" for k, v in trackables.items() if hasattr(v, "inner")]
            fix = f"pass {', '.join(wrapped)} (the wrapped optimizer)" if wrapped else (
                "pass objects that own variables (tf.Variable, keras.Model, a Keras optimizer)")
            raise ConfigError(f"{err} Fix: {fix}.") from err
        self.directory = Path(directory).absolute()
        self.is_chief = bool(is_chief)
        self.keep = keep
        self._names = tuple(trackables)
        self._trackables = dict(trackables)

    def _scan(self) -> list[tuple[int, int, Path]]:
        """(sequence, step, folder) of the complete checkpoints, oldest first."""
        try:
            entries = sorted(e.name for e in os.scandir(self.directory))
        except FileNotFoundError:
            return []
        except OSError as err:
            raise CheckpointError(f"Could not list checkpoint directory {self.directory}: {err}.") from err
        found: dict[int, tuple[int, int, Path]] = {}
        for name in entries:
            match = _FINAL.fullmatch(name) or _REPLACED.fullmatch(name)
            record = _load(self.directory / name) if match else None
            if match is None or record is None:
                continue
            step = int(match.group(1))
            # A complete .replaced- folder whose final name is missing is what a run killed between the two
            # renames of an overwrite leaves: the previous version of that step, still valid.
            if name.startswith("ckpt-") or step not in found:
                found[step] = (record["sequence"], step, self.directory / name)
        return sorted(found.values())

    def all(self) -> list[Path]:
        """The complete checkpoint folders, oldest (first saved) first."""
        return [folder for _, _, folder in self._scan()]

    def latest(self) -> Path | None:
        """The most recently saved complete checkpoint folder, or None if there is none."""
        found = self._scan()
        return found[-1][2] if found else None

    def newest_intact(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The most recently saved checkpoint that reads back whole (:func:`damage`), and the newer ones skipped.

        Returns:
          (folder or None when none is intact, [(damaged folder, why)] newest first).
        """
        skipped: list[tuple[Path, str]] = []
        unlisted = self._unreadable_metadata()
        for folder in reversed(self.all()):
            why = damage(folder)
            if why is None:
                step = int(_FINAL.fullmatch(folder.name).group(1)) if _FINAL.fullmatch(folder.name) else -1
                return folder, [*sorted(((f, w) for f, w, s in unlisted if s > step), reverse=True), *skipped]
            skipped.append((folder, why))
        return None, [*sorted(((f, w) for f, w, _ in unlisted), reverse=True), *skipped]

    def _unreadable_metadata(self) -> list[tuple[Path, str, int]]:
        """Published folders (a final name only ever appears by a rename of a complete one) whose checkpoint.json
        no longer reads: damaged after they were published. ``all()`` cannot order them (their save order is in
        that file), so a resume names those with a higher step than the one it takes, instead of passing over
        them in silence."""
        try:
            entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
        except OSError:
            return []
        found = []
        for entry in entries:
            match = _FINAL.fullmatch(entry.name)
            folder = Path(entry.path)
            if match and (folder / f"{_PREFIX}.index").is_file() and _load(folder) is None:
                found.append((folder, f"its {METADATA_FILE} cannot be read (torn or damaged)", int(match.group(1))))
        return found

    def save(self, step: int, metadata: Mapping[str, Any] | None = None) -> Path | None:
        """Writes a checkpoint to ``directory/ckpt-<step:08d>`` (chief only).

        Saving a step that exists replaces it atomically. Afterwards only the
        newest ``keep`` checkpoints remain.

        Args:
          step: the global step (int >= 0), used in the folder name.
          metadata: JSON-serialisable values stored in ``checkpoint.json``
            (epoch, position in the epoch, config); read back with
            ``read_metadata``. Keys "step", "time" and "sequence" are reserved.

        Returns:
          The new folder on the chief, None on other ranks (which write nothing).

        Raises:
          hvrep.errors.ConfigError: a bad step or metadata (on every rank).
          hvrep.errors.CheckpointError: the write failed (disk full, permissions);
            the previous checkpoints are intact and nothing partial is left.
        """
        user = self._check(step, metadata)
        if not self.is_chief:
            return None
        step = int(step)
        final = self.directory / _folder_name(step)
        tmp = self.directory / f".tmp-ckpt-{step}-{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._clean_up()
            found = self._scan()
            record = {**user, "step": step, "time": time.time(), "sequence": found[-1][0] + 1 if found else 0}
            self._write(tmp, record)
            if faultpoint.ARMED:
                faultpoint.reached("ckpt.before_rename", where=self.directory)
            self._install(tmp, final, step)
        except (OSError, tf.errors.OpError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(self._failure(step, err)) from err
        for _, _, folder in self._scan()[: -self.keep]:
            self._delete(folder)
        return final

    @property
    def trackables(self) -> dict[str, Any]:
        """What is saved, by name (a copy of the constructor's keywords)."""
        return dict(self._trackables)

    def restore(self, path: str | os.PathLike | None = None, without: tuple[str, ...] = (),
                replace: Mapping[str, Any] | None = None) -> Path | None:
        """Restores a checkpoint into the trackables given at construction.

        Every rank may call this; all read the same folder. See the class
        docstring for optimizers that are not built yet. Values in the
        checkpoint that no trackable asks for (e.g. restoring only the model)
        are allowed.

        Args:
          path: a checkpoint folder; None: ``latest()``.
          without: names of trackables to leave as they are (e.g. state the
            saving run did not have).
          replace: trackables to read in place of the constructor's, by name, for
            this restore only (e.g. an object that holds one under the nesting
            an older layout saved it in).

        Returns:
          The folder restored, or None when ``path`` is None and there is no
          checkpoint yet (a fresh start: nothing was changed). With ``path``
          None, a damaged newest checkpoint is skipped with a warning naming it
          and why, and the newest intact one is restored.

        Raises:
          hvrep.errors.CheckpointError: ``path`` is not a complete checkpoint (the
            message lists the available ones), every checkpoint is damaged, or it
            does not match the trackables.
        """
        if path is None:
            folder, skipped = self.newest_intact()
            for bad, why in skipped:
                warnings.warn(skipped_message(bad, why, folder), stacklevel=2)
            if folder is None:
                if skipped:
                    raise CheckpointError(all_damaged_message(self.directory, skipped))
                return None
        else:
            folder = Path(path).absolute()
            unfinished = folder.name.startswith(_GARBAGE)
            if unfinished or _load(folder) is None:
                why = (
                    "does not exist" if not folder.exists()
                    else "is the temporary folder of an unfinished save or deletion" if unfinished
                    else f"has no readable {_PREFIX}.index and {METADATA_FILE}: it was never completed"
                )
                available = ", ".join(p.name for p in self.all()) or "none"
                raise CheckpointError(
                    f"Cannot restore {folder}: it {why}. Available in {self.directory}: {available}. "
                    "Fix: pass one of those, or path=None for the newest."
                )
        replace = dict(replace or {})
        for argument, names in (("without", without), ("replace", replace)):
            unknown = sorted(set(names) - set(self._names))
            if unknown:
                raise ConfigError(f"{argument} names {unknown}, which are not among the trackables "
                                  f"{list(self._names)}.")
        checkpoint = tf.train.Checkpoint(**{k: replace.get(k, v) for k, v in self._trackables.items()
                                            if k not in without}) if without or replace else self._checkpoint
        names = [k for k in self._names if k not in without]
        try:
            status = checkpoint.read(str(folder / _PREFIX))
            status.expect_partial()  # extra values in the checkpoint are fine (see docstring)
            status.assert_existing_objects_matched()
        # A truncated data file raises IndexError ("Read less bytes than requested", TF 2.21).
        except (tf.errors.OpError, AssertionError, ValueError, IndexError) as err:
            raise CheckpointError(
                f"Could not restore {folder} into {', '.join(names)}: {err}. Fix: create the objects as the "
                "saving run did (same model architecture, optimizer class and keyword names), or start a new directory."
            ) from err
        return folder

    def _check(self, step: Any, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}. Fix: pass int(step_variable.numpy()).")
        user = dict(metadata or {})
        reserved = sorted(set(user) & set(_RESERVED))
        if reserved:
            raise ConfigError(f"metadata keys {reserved} are reserved (written by the manager). Fix: rename them.")
        try:
            json.dumps(user)
        except (TypeError, ValueError) as err:
            raise ConfigError(
                f"metadata must be JSON-serialisable: {err}. Fix: convert tensors and arrays with int(), float() "
                "or .tolist()."
            ) from err
        return user

    def _write(self, tmp: Path, record: dict[str, Any]) -> None:
        tmp.mkdir()
        if faultpoint.ARMED:  # the fault campaign's points (benchmarks/faults.py); False otherwise
            faultpoint.reached("ckpt.before_data", where=self.directory)
        self._checkpoint.write(str(tmp / _PREFIX))
        if faultpoint.ARMED:
            faultpoint.reached("ckpt.data", where=self.directory, data_file=tmp / f"{_PREFIX}.data-00000-of-00001")
            faultpoint.reached("ckpt.before_metadata", where=self.directory)
        with open(tmp / METADATA_FILE, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        for file in tmp.iterdir():
            _fsync(file)
        _fsync(tmp, directory=True)

    def _install(self, tmp: Path, final: Path, step: int) -> None:
        """Renames the complete ``tmp`` to ``final``, replacing a previous save of the same step."""
        if not final.exists():
            os.replace(tmp, final)
            _fsync(self.directory, directory=True)
            return
        # A non-empty directory cannot be replaced in one rename; the old one goes aside first. Killed
        # between the two renames, the .replaced- folder still counts as the step's checkpoint (_scan).
        aside = self.directory / f".replaced-ckpt-{step}-{os.getpid()}"
        os.replace(final, aside)
        try:
            os.replace(tmp, final)
        except OSError:
            os.replace(aside, final)
            raise
        _fsync(self.directory, directory=True)
        self._delete(aside)

    def _clean_up(self) -> None:
        """Removes what a killed save left; puts back a previous version an overwrite had moved aside."""
        for entry in os.scandir(self.directory):
            path = Path(entry.path)
            if entry.name.startswith(_GARBAGE):
                shutil.rmtree(path, ignore_errors=True)
            elif match := _REPLACED.fullmatch(entry.name):
                final = self.directory / _folder_name(int(match.group(1)))
                if not final.exists() and _load(path) is not None:
                    os.replace(path, final)
                else:
                    self._delete(path)

    def _delete(self, folder: Path) -> None:
        # Renamed first, so a deletion cut short never leaves a partial folder under a final name.
        doomed = self.directory / f".deleting-{folder.name.lstrip('.')}-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(folder, doomed)
        except OSError as err:
            warnings.warn(f"Could not delete old checkpoint {folder}: {err}. Fix: delete it by hand.", stacklevel=3)
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def _failure(self, step: int, err: BaseException) -> str:
        try:
            usage = shutil.disk_usage(self.directory if self.directory.exists() else self.directory.parent)
            free = f"{_gib(usage.free)} free of {_gib(usage.total)}"
        except OSError as disk_err:
            free = f"unknown ({disk_err})"
        try:
            previous = self.latest()
            need = f"; the previous one took {_gib(_size(previous))}" if previous else ""
        except (OSError, CheckpointError):
            previous, need = None, ""
        return (
            f"Could not save checkpoint step {step} in {self.directory}: {err}. Free space there: {free}{need}. "
            f"The previous checkpoints are intact (newest: {previous.name if previous else 'none'}) and nothing "
            f"partial was left. Fix: free space or point the CheckpointManager at a larger filesystem; a smaller "
            f"keep (now {self.keep}) also needs less."
        )
