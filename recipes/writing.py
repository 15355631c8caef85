"""Writing synthetic data sets reproducibly and safely from many processes.

What the CosmoFlow universe writer (`recipes.cosmoflow.universe`,
`tools/write_universes.py`) and the segmentation writer (`recipes.unet3d.segmentation`,
`tools/write_segmentation.py`) share:

- `check_seed` and `sample_rng`: the random stream of one sample depends only on (seed,
  index, stream), so any split of the indices over processes writes the same bytes.
- `atomic_h5_file`: files are written under a hidden temporary name and renamed, so an
  interrupted write never leaves a half-written file under the final name.
- `plan_writes`: resume support; complete files are skipped, leftovers of interrupted
  writes removed, files of another data set reported instead of overwritten.
- `run_jobs` and `progress_bar`: a process pool with a `tqdm` progress bar on stderr.
- `write_planned`: plan, report and write, as the command-line writers do.
- `prepare_output_directory`, `default_workers`, `shard_from_environment` and
  `resolve_shard`: the output directory, the worker count and this writer's share of the
  indices under horovodrun.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence

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


def progress_bar(total: int, label: str, *, enabled: bool = True, stream: Optional[Any] = None):
    """A `tqdm` progress bar of `total` items labelled `label`, on stderr by default.

    On a terminal the bar is redrawn in place; in a pipe or log file a line is written
    at most every 10 seconds (and at the end), so logs stay short.

    Args:
        total: the number of items.
        label: what is counted, e.g. "universes" (the bar's description and unit).
        enabled: draw nothing when False. Defaults to True.
        stream: where to write. Defaults to `sys.stderr`.
    """
    from tqdm import tqdm

    stream = stream if stream is not None else sys.stderr
    tty = bool(getattr(stream, "isatty", lambda: False)())
    return tqdm(total=int(total), desc=label, unit="", file=stream, disable=not enabled,
                mininterval=0.2 if tty else 10.0, dynamic_ncols=tty, ascii=not tty)


def run_jobs(
    function: Callable[[Any], Any],
    jobs: Sequence[Any],
    *,
    workers: int = 1,
    progress: Optional[Any] = None,
) -> list[Any]:
    """Runs `function(job)` for every job, in a process pool when `workers > 1`.

    Each job must be independent (e.g. writes its own file). `function` and the jobs
    must be picklable (module-level functions, `functools.partial` of them).

    Args:
        function: called once per job in a worker process.
        jobs: the work items.
        workers: number of processes; 1 runs in the calling process. Defaults to 1.
        progress: a progress bar (`tqdm.tqdm` or anything with `update(n)` and
            `close()`), updated once per finished job, then closed. Defaults to None.

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
                progress.update(1)
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
                    progress.update(1)
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
    jobs left with a `tqdm` progress bar on stderr labelled `label` (redrawn in place on a
    terminal, a line every 10 seconds in a log file).

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
    progress = progress_bar(len(to_write), label, enabled=not quiet)
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
