"""Recipes: synthetic scientific data sets and the machinery that writes them.

`recipes.cosmoflow` makes lognormal universes for CosmoFlow, `recipes.unet3d` makes
ellipsoid segmentation volumes for the 3D U-Net. This module holds what both writers
share, so each data set stays reproducible and safe to write from many processes:

- `sample_rng`: the random stream of one sample depends only on (seed, index, stream),
  so any split of the indices over processes writes the same bytes.
- `atomic_h5_file`: files are written under a hidden temporary name and renamed, so an
  interrupted write never leaves a half-written file under the final name.
- `plan_writes`: resume support; complete files are skipped, leftovers of interrupted
  writes removed, files of another data set reported instead of overwritten.
- `run_jobs` and `ProgressLine`: a process pool with a text progress line on stderr.
- `prepare_output_directory`, `int_argument`, `default_workers`, `shard_from_environment`:
  what the command-line writers in tools/ share.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence, TextIO

import numpy as np

MAX_SEED = 2**63 - 1
TEMP_SUFFIX = ".tmp"


def check_seed(seed: int) -> int:
    """Returns `seed` as an int after checking it is in [0, 2**63 - 1].

    Raises:
        ValueError: if `seed` is not an integer in range.
    """
    if isinstance(seed, bool) or int(seed) != seed or not 0 <= int(seed) <= MAX_SEED:
        raise ValueError(
            f"`seed` must be an integer in [0, 2**63 - 1]. Received: seed={seed!r}."
        )
    return int(seed)


def sample_rng(seed: int, index: int, stream: int = 0) -> np.random.Generator:
    """A random generator that depends only on (seed, index, stream).

    Streams separate the uses inside one sample (e.g. labels, noise, Poisson draws), so
    changing how much one use consumes never shifts the others.

    Args:
        seed: the data set seed, an integer in [0, 2**63 - 1].
        index: the sample index, a non-negative integer.
        stream: which independent stream of that sample. Defaults to 0.

    Returns:
        A `numpy.random.Generator` (PCG64) seeded from
        `SeedSequence(seed, spawn_key=(index, stream))`.

    Raises:
        ValueError: if an argument is negative or not an integer.
    """
    check_seed(seed)
    for name, value in (("index", index), ("stream", stream)):
        if isinstance(value, bool) or int(value) != value or value < 0:
            raise ValueError(
                f"`{name}` must be a non-negative integer. Received: {name}={value!r}."
            )
    sequence = np.random.SeedSequence(int(seed), spawn_key=(int(index), int(stream)))
    return np.random.Generator(np.random.PCG64(sequence))


def temp_prefix(path: str) -> str:
    """The prefix of the hidden temporary names used while writing `path`."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.")


def remove_stale_temp_files(path: str) -> int:
    """Deletes temporary files left by an interrupted write of `path`.

    Only call this for files the calling process owns: a concurrent writer of the same
    final name would lose its temporary file.

    Returns:
        The number of files removed.
    """
    prefix = temp_prefix(path)
    directory, head = os.path.split(prefix)
    removed = 0
    for name in os.listdir(directory or "."):
        if name.startswith(head) and name.endswith(TEMP_SUFFIX):
            os.remove(os.path.join(directory, name))
            removed += 1
    return removed


@contextlib.contextmanager
def atomic_h5_file(path: str) -> Iterator[Any]:
    """Opens a new HDF5 file that appears under `path` only once fully written.

    The file is written as `.<name>.<unique>.tmp` in the same directory, synced to disk
    and renamed over `path` (atomic on POSIX file systems). On any exception the
    temporary file is removed and `path` is left as it was.

    Args:
        path: the final file name.

    Yields:
        An `h5py.File` opened for writing.
    """
    import h5py

    temp_path = f"{temp_prefix(path)}{os.getpid()}-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
    try:
        with h5py.File(temp_path, "w") as h5:
            yield h5
        with open(temp_path, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp_path)
        raise


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class ProgressLine:
    """A one-line text progress report: count/total, percent, rate and ETA.

    On a terminal the line is redrawn in place at most every `interval` seconds; on a
    pipe or log file a new line is printed at most every `log_interval` seconds. The
    final report is always printed.

    Args:
        total: number of items expected.
        label: what is counted, e.g. "universes". Defaults to "items".
        stream: where to write. Defaults to `sys.stderr`.
        interval: seconds between redraws on a terminal. Defaults to 0.2.
        log_interval: seconds between lines when not a terminal. Defaults to 10.
        enabled: print nothing when False. Defaults to True.

    Example:
    >>> progress = ProgressLine(total=3, label="files", enabled=False)
    >>> for _ in range(3):
    ...     progress.advance()
    >>> progress.close()
    """

    def __init__(
        self,
        total: int,
        *,
        label: str = "items",
        stream: Optional[TextIO] = None,
        interval: float = 0.2,
        log_interval: float = 10.0,
        enabled: bool = True,
    ):
        self.total = int(total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self._start = time.monotonic()
        self._last = float("-inf")
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._interval = interval if self._tty else log_interval

    def __repr__(self) -> str:
        return f"ProgressLine(label={self.label!r}, done={self.done}, total={self.total})"

    def text(self) -> str:
        """The current report, e.g. "universes 3/10 (30%) 1.52/s ETA 0:00:05"."""
        elapsed = time.monotonic() - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        percent = 100.0 * self.done / self.total if self.total else 100.0
        if self.done >= self.total:
            tail = f"done in {_format_duration(elapsed)}"
        elif rate > 0:
            tail = f"ETA {_format_duration((self.total - self.done) / rate)}"
        else:
            tail = "ETA ?"
        return f"{self.label} {self.done}/{self.total} ({percent:.0f}%) {rate:.2f}/s {tail}"

    def advance(self, count: int = 1) -> None:
        """Counts `count` more finished items and redraws if due."""
        self.done += count
        now = time.monotonic()
        if self.done >= self.total or now - self._last >= self._interval:
            self._last = now
            self._write(final=False)

    def close(self) -> None:
        """Prints the final report and ends the line."""
        self._write(final=True)

    def _write(self, final: bool) -> None:
        if not self.enabled:
            return
        if self._tty:
            self.stream.write("\r" + self.text() + ("\n" if final else ""))
        elif final or self.done < self.total:
            self.stream.write(self.text() + "\n")
        self.stream.flush()


def run_jobs(
    function: Callable[[Any], Any],
    jobs: Sequence[Any],
    *,
    workers: int = 1,
    progress: Optional[ProgressLine] = None,
) -> list[Any]:
    """Runs `function(job)` for every job, in a process pool when `workers > 1`.

    Each job must be independent (e.g. writes its own file). `function` and the jobs
    must be picklable (module-level functions, `functools.partial` of them).

    Args:
        function: called once per job in a worker process.
        jobs: the work items.
        workers: number of processes; 1 runs in the calling process. Defaults to 1.
        progress: advanced once per finished job, then closed. Defaults to None.

    Returns:
        The results, in the order of `jobs`.

    Raises:
        ValueError: if `workers < 1`.
    """
    if isinstance(workers, bool) or int(workers) != workers or workers < 1:
        raise ValueError(f"`workers` must be a positive integer. Received: workers={workers!r}.")
    results: list[Any] = [None] * len(jobs)
    if workers == 1 or len(jobs) <= 1:
        for position, job in enumerate(jobs):
            results[position] = function(job)
            if progress is not None:
                progress.advance()
    else:
        numbered = list(enumerate(jobs))
        # "spawn", not the Linux default "fork": a process that has started threads
        # (TensorFlow, Horovod, a test runner that imported them) can fork a child that
        # inherits a held lock and never runs (a pytest run hung so).
        with multiprocessing.get_context("spawn").Pool(min(int(workers), len(jobs))) as pool:
            calls = pool.imap_unordered(_NumberedCall(function), numbered, chunksize=1)
            for position, result in calls:
                results[position] = result
                if progress is not None:
                    progress.advance()
    if progress is not None:
        progress.close()
    return results


class _NumberedCall:
    """Picklable wrapper returning (position, function(job)) for unordered pools."""

    def __init__(self, function: Callable[[Any], Any]):
        self.function = function

    def __call__(self, numbered_job: tuple[int, Any]) -> tuple[int, Any]:
        position, job = numbered_job
        return position, self.function(job)


def shard_from_environment() -> tuple[int, int]:
    """(rank, size) of this process under horovodrun, or (0, 1) when not launched by it.

    Reads `HOROVOD_RANK` and `HOROVOD_SIZE`, which horovodrun sets for every rank; rank r
    of a writer then handles indices r, r + size, r + 2 * size, ...
    """
    try:
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    except (KeyError, ValueError):
        return 0, 1


def prepare_output_directory(path: str) -> str:
    """Creates `path` if needed and checks that files can be created in it.

    Returns:
        The absolute path.

    Raises:
        ValueError: if `path` is not a directory, cannot be created or is not writable.
    """
    directory = os.path.abspath(path)
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(
            f"The output path exists and is not a directory. Received: out={path!r}."
        ) from None
    except OSError as error:
        raise ValueError(
            f"Cannot create the output directory ({error.strerror}). Received: out={path!r}."
        ) from None
    try:
        probe = os.path.join(directory, f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as error:
        raise ValueError(
            f"The output directory is not writable ({error.strerror}). Received: out={path!r}."
        ) from None
    return directory


def int_argument(name: str, minimum: int) -> Callable[[str], int]:
    """An argparse `type` accepting integers >= `minimum`, with a clear error.

    Example:
    >>> int_argument("count", 1)("3")
    3
    """
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be an integer of at least {minimum}. Received: {name}={text!r}."
            )
        return value

    return parse


def default_workers(jobs: int) -> int:
    """Worker processes to use by default: the CPUs available, at most `jobs`, and 1
    when several horovodrun ranks already share the machine."""
    if shard_from_environment()[1] > 1:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, jobs))


def plan_writes(
    jobs: Sequence[Any],
    *,
    path_of: Callable[[Any], str],
    status_of: Callable[[Any], tuple[str, str]],
    overwrite: bool = False,
) -> tuple[list[Any], int, list[str]]:
    """Decides which files of a resumed (or fresh) write still need writing.

    Removes temporary files left by interrupted writes of these jobs, then asks
    `status_of(job)` for ("missing" | "complete" | "incomplete" | "mismatch", reason).

    Args:
        jobs: the jobs this process owns.
        path_of: the final path of a job's file.
        status_of: the status of a job's existing file.
        overwrite: write every job whatever exists. Defaults to False.

    Returns:
        (jobs to write, number of complete files skipped, "path: reason" for files of
        another data set, which are never overwritten without `overwrite`).
    """
    to_write, skipped, mismatched = [], 0, []
    for job in jobs:
        remove_stale_temp_files(path_of(job))
        status, reason = ("missing", "") if overwrite else status_of(job)
        if status == "complete":
            skipped += 1
        elif status == "mismatch":
            mismatched.append(f"{path_of(job)}: {reason}")
        else:
            to_write.append(job)
    return to_write, skipped, mismatched


def write_planned(
    jobs: Sequence[Any],
    *,
    write: Callable[[Any], Any],
    path_of: Callable[[Any], str],
    status_of: Callable[[Any], tuple[str, str]],
    overwrite: bool,
    workers: Optional[int],
    quiet: bool,
    label: str,
    describe: Callable[[int, int, int], str],
) -> int:
    """What the writer CLIs do once they have their jobs: plan, report, write.

    Plans the writes (`plan_writes`), refuses files of another data set, prints
    `describe(to_write, skipped, workers)` unless `quiet`, and runs `write` over the
    jobs left with a progress line labelled `label`.

    Returns:
        The process exit status: 1 if existing files belong to another data set, else 0.
    """
    to_write, skipped, mismatched = plan_writes(
        jobs, path_of=path_of, status_of=status_of, overwrite=overwrite
    )
    if mismatched:
        print(
            f"error: {len(mismatched)} existing file(s) belong to another data set; use "
            "--overwrite or another --out. First: " + "; ".join(mismatched[:3]),
            file=sys.stderr,
        )
        return 1
    workers = workers or default_workers(len(to_write))
    if not quiet:
        print(describe(len(to_write), skipped, workers), file=sys.stderr)
    progress = ProgressLine(len(to_write), label=label, enabled=not quiet)
    run_jobs(write, to_write, workers=workers, progress=progress)
    return 0


def resolve_shard(shard_index: Optional[int], num_shards: Optional[int]) -> tuple[int, int]:
    """(shard, shards) from explicit values, else from horovodrun's environment.

    Raises:
        ValueError: unless 0 <= shard < shards.
    """
    env_index, env_shards = shard_from_environment()
    shard = env_index if shard_index is None else int(shard_index)
    shards = env_shards if num_shards is None else int(num_shards)
    if not 0 <= shard < shards:
        raise ValueError(
            "The shard index must be in [0, num_shards). "
            f"Received: shard_index={shard}, num_shards={shards}."
        )
    return shard, shards
