"""Horovod start-up and process sets."""

from __future__ import annotations

import os
import socket
import time
from typing import Callable, Optional, Sequence

# Variables Horovod's launchers (horovodrun/horovod.run with Gloo, mpirun, srun) set.
_LAUNCH_VARIABLES = (
    "HOROVOD_RANK",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
)
_SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")

# Up to this world size every process set any mesh can need is created at start-up.
ALL_MESHES_MAX_WORLD = 64

# How Horovod's own threads are scheduled: "idle" (the default) or "normal".
COMM_THREADS_VARIABLE = "KERAS_SPATIAL_COMM_THREADS"
COMM_THREAD_POLICIES = ("idle", "normal")
# Horovod's cycle time (ms) under the "idle" policy, unless HOROVOD_CYCLE_TIME is set.
IDLE_POLICY_CYCLE_TIME_MS = "0.2"
# Whether the ranks that share a machine get their own CPUs: "auto" (the default) or "none".
BIND_VARIABLE = "KERAS_SPATIAL_BIND"
BIND_POLICIES = ("auto", "none")

_process_sets: dict[tuple[int, ...], object] = {}


def available() -> bool:
    """Whether Horovod with TensorFlow support can be imported."""
    try:
        import horovod.tensorflow  # noqa: F401
    except Exception:  # ImportError, or a build against another TensorFlow
        return False
    return True


def launched_by_horovod() -> bool:
    """Whether this process was started by a Horovod-aware launcher."""
    return any(name in os.environ for name in _LAUNCH_VARIABLES)


def _hvd():
    import horovod.tensorflow as hvd

    return hvd


def world_size_from_environment() -> Optional[int]:
    """The world size the launcher announced, before Horovod starts (None if unknown)."""
    for name in _SIZE_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def mesh_groups(world_size: int, spatial_size: int) -> list[tuple[int, ...]]:
    """The process sets of meshes with `spatial_size` ranks per sample: contiguous
    spatial groups and strided position groups (singletons and the world left out)."""
    if world_size % spatial_size:
        return []
    spatial = [tuple(range(s, s + spatial_size)) for s in range(0, world_size, spatial_size)]
    position = [tuple(range(i, world_size, spatial_size)) for i in range(spatial_size)]
    return [g for g in spatial + position if 1 < len(g) < world_size]


def initialize(spatial_size: int) -> tuple[int, int]:
    """Initialize Horovod once, with static process sets; return (rank, size).

    Horovod's process sets are fixed at `hvd.init()` unless made dynamic, and sets added
    dynamically are not usable at once on every rank (Horovod 0.28.1 on Gloo fails ops
    with "Process set provided does not exist" for a while after `add_process_set`
    returns) and slow its background loop. So the sets are static: for worlds of up to
    ALL_MESHES_MAX_WORLD ranks, those of every possible mesh (the spatial size must
    divide the world size, so there are few), so that several strategies with different
    meshes can be created one after another; for larger worlds, those of the first
    strategy's spatial size.

    Horovod's threads are then scheduled as `KERAS_SPATIAL_COMM_THREADS` says (see
    `comm_thread_policy`; by default they run only on cores no other thread wants), and
    the process is bound to its share of this machine's CPUs as `KERAS_SPATIAL_BIND`
    says (see `bind_to_local_share`).

    Raises:
        ValueError: if `KERAS_SPATIAL_COMM_THREADS` or `KERAS_SPATIAL_BIND` holds an
            unknown policy.
    """
    hvd = _hvd()
    if not hvd.is_initialized():
        world_size = world_size_from_environment()
        groups: list[tuple[int, ...]] = []
        if world_size is not None:
            sizes = (
                [s for s in range(2, world_size) if world_size % s == 0]
                if world_size <= ALL_MESHES_MAX_WORLD
                else [spatial_size]
            )
            for size in sizes:
                groups += [g for g in mesh_groups(world_size, size) if g not in groups]
        sets = [hvd.ProcessSet(list(g)) for g in groups]
        policy, bind = comm_thread_policy(), bind_policy()
        if policy == "idle":
            os.environ.setdefault("HOROVOD_CYCLE_TIME", IDLE_POLICY_CYCLE_TIME_MS)
        threads_before = _thread_ids()
        hvd.init(process_sets=sets)
        if policy == "idle":
            _schedule_when_idle(_thread_ids() - threads_before)
        _process_sets.clear()
        _process_sets.update({tuple(s.ranks): s for s in sets})
        for own_set in sets:  # the same order on every member of each set
            if hvd.rank() in own_set.ranks:
                _wait_until_usable(own_set)
        if hvd.size() > 1:
            # Every rank takes part in the allgather, whatever its policy or machine.
            affinities = _machine_affinities()
            if bind == "auto":
                bind_to_local_share(hvd.local_rank(), hvd.local_size(), affinities)
    return hvd.rank(), hvd.size()


def comm_thread_policy() -> str:
    """The scheduling of Horovod's threads that `KERAS_SPATIAL_COMM_THREADS` asks for.

    "idle" (the default): Horovod's background thread and its Gloo threads go into
    Linux's SCHED_IDLE class, so they run only on a core no training thread wants.
    Horovod's background thread wakes every `HOROVOD_CYCLE_TIME` (1 ms) to coordinate
    with the other ranks even when nothing is queued; on a machine whose cores all run
    training threads, those wake-ups preempt the computation. Measured on 2 cores, an
    idle 2-rank Horovod job made two independent training processes 15-40% slower; in
    SCHED_IDLE its cost was within the run-to-run noise of about 10%
    (docs/benchmarks.md). Collectives still progress as soon as a rank waits for one,
    because its core then falls idle.
    Since its wake-ups then cost the computation little, the "idle" policy also
    shortens Horovod's cycle to IDLE_POLICY_CYCLE_TIME_MS (0.2 ms) unless
    HOROVOD_CYCLE_TIME is set: a small collective then took about 0.6 ms instead of
    1.1-1.4 ms on 2 cores (3-4 ms with policy "normal" and Horovod's 1 ms default).
    "normal": leave them as Horovod starts them, and its cycle time alone (e.g. when
    cores are reserved for communication, or to overlap allreduces with computation).

    Raises:
        ValueError: for any other value.
    """
    return _policy_from_environment(COMM_THREADS_VARIABLE, COMM_THREAD_POLICIES)


def bind_policy() -> str:
    """Whether `initialize` binds this process to its share of the machine's CPUs, as
    `KERAS_SPATIAL_BIND` says: "auto" (the default) or "none".

    "auto": when several ranks of the job run on this machine and the launcher gave
    them all the same CPUs, local rank i is bound to its own block of them (see
    `bind_to_local_share`). Measured on 2 cores, a spatial 2x1x1 CosmoFlow step whose
    2 ranks the scheduler may move between the cores was about 4% slower than with
    each rank on its own core (steps alternated in one job; docs/benchmarks.md).
    "none": leave the CPUs as the launcher set them.

    Raises:
        ValueError: for any other value.
    """
    return _policy_from_environment(BIND_VARIABLE, BIND_POLICIES)


def _policy_from_environment(variable: str, policies: Sequence[str]) -> str:
    """The value of `variable`, lower case, one of `policies` (the first when unset or
    empty); a ValueError naming the variable and the choices for any other."""
    policy = os.environ.get(variable, "").strip().lower() or policies[0]
    if policy not in policies:
        raise ValueError(
            f"{variable} must be one of {', '.join(policies)}. Received: {os.environ[variable]!r}"
        )
    return policy


def local_cpu_share(cpus: Sequence[int], local_rank: int, local_size: int) -> set[int]:
    """The CPUs of local rank `local_rank` when `local_size` ranks share `cpus`.

    Each rank gets a contiguous block of the sorted CPUs, the blocks as equal as they
    can be; with fewer CPUs than ranks, rank i gets CPU i modulo their number (ranks
    then share CPUs, as many to each as possible).

    Example:
    >>> sorted(local_cpu_share(range(8), 1, 2)), sorted(local_cpu_share([0, 1], 3, 4))
    ([4, 5, 6, 7], [1])

    Raises:
        ValueError: if `cpus` is empty or `local_rank` is not in [0, local_size).
    """
    cpus = sorted(cpus)
    if not cpus or not 0 <= local_rank < local_size:
        raise ValueError(
            "local_cpu_share needs some CPUs and 0 <= local_rank < local_size. "
            f"Received: cpus={cpus}, local_rank={local_rank}, local_size={local_size}"
        )
    if len(cpus) < local_size:
        return {cpus[local_rank % len(cpus)]}
    start, stop = (local_rank * len(cpus)) // local_size, ((local_rank + 1) * len(cpus)) // local_size
    return set(cpus[start:stop])


def bind_to_local_share(local_rank: int, local_size: int, machine_affinities) -> Optional[set[int]]:
    """Bind every thread of this process to its share of the CPUs (`local_cpu_share`).

    Only when `local_size` > 1 ranks share this machine and all of them may run on the
    same CPUs (`machine_affinities`: the CPU set of every rank on this machine). A
    launcher that binds ranks itself (`srun --cpu-bind`, `mpirun --bind-to`) gives them
    different sets, and its binding is kept. Threads the process starts later inherit
    the binding from the thread that starts them. A no-op where the platform cannot
    bind threads (not Linux).

    Returns:
        The CPUs the process is now bound to, or None if it was left as it was.
    """
    if local_size <= 1 or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    if any(set(cpus) != allowed for cpus in machine_affinities):
        return None
    share = local_cpu_share(allowed, local_rank, local_size)
    _for_each_thread(lambda thread_id: os.sched_setaffinity(thread_id, share))
    return share


def _machine_affinities() -> list[list[int]]:
    """The CPU sets of the ranks that run on this machine (one allgather over the
    world: every rank must call it)."""
    # By host name: Horovod's cross_rank numbers the ranks of equal local rank, which
    # is not the machine's index when machines run different numbers of ranks.
    host = socket.gethostname()
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    everyone = _hvd().allgather_object((host, affinity), name="ks_affinities")
    return [cpus for name, cpus in everyone if name == host]


def _thread_ids() -> set[int]:
    """The ids of this process's threads (empty where /proc is not available)."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _for_each_thread(action: Callable[[int], object], thread_ids=None) -> list:
    """`action(thread_id)` for the threads `thread_ids` of this process (default: all of
    them, `_thread_ids()`), skipping any that ends meanwhile.

    Returns:
        The results of the calls, in no particular order.
    """
    results = []
    for thread_id in _thread_ids() if thread_ids is None else thread_ids:
        try:
            results.append(action(thread_id))
        except ProcessLookupError:  # ended meanwhile
            pass
    return results


def _schedule_when_idle(thread_ids) -> None:
    """Put the threads `thread_ids` of this process into the SCHED_IDLE class.

    A no-op where the platform has no SCHED_IDLE (not Linux). A thread that has ended
    meanwhile is skipped.
    """
    if not hasattr(os, "SCHED_IDLE"):
        return
    _for_each_thread(lambda thread_id: os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0)),
                    thread_ids)


def _wait_until_usable(process_set, timeout: float = 120.0) -> None:
    """Block until the members of `process_set` can run collectives on it.

    `hvd.init` returns before Horovod's background thread has activated the process
    sets; an op enqueued at once fails with "Process set provided does not exist, or has
    not been registered" (seen with Horovod 0.28.1 on Gloo, static and dynamic sets
    alike). That check is local and fails immediately, so retrying a tiny allreduce until
    it goes through is safe, and its completion shows every member has the set.
    """
    import tensorflow as tf

    hvd = _hvd()
    deadline = time.monotonic() + timeout
    while True:
        try:
            hvd.allreduce(
                tf.zeros([1]), op=hvd.Sum, name=f"ks_set_ready_{process_set.process_set_id}",
                process_set=process_set,
            )
            return
        except tf.errors.InvalidArgumentError as error:
            if "does not exist" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def process_set(ranks: Sequence[int]) -> Optional[object]:
    """The Horovod process set of exactly `ranks`.

    Returns the global process set for the whole world and None for a single rank
    (nothing to communicate).

    Raises:
        ValueError: if the set was not created at start-up (see `initialize`).
    """
    hvd = _hvd()
    key = tuple(sorted(int(r) for r in ranks))
    if len(key) <= 1:
        return None
    if key == tuple(range(hvd.size())):
        return hvd.global_process_set
    if key not in _process_sets:
        raise ValueError(
            f"No Horovod process set for ranks {list(key)}. Horovod fixes its process sets "
            "when it starts; in worlds of more than "
            f"{ALL_MESHES_MAX_WORLD} ranks only the first SpatialStrategy's spatial size is "
            "prepared, so all strategies of one job must split samples into the same number "
            f"of shards. Received: ranks={list(key)}, world_size={hvd.size()}"
        )
    return _process_sets[key]
