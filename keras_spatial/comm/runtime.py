"""Horovod start-up and process sets."""

from __future__ import annotations

import os
from typing import Optional, Sequence

# Variables Horovod's launchers (horovodrun/horovod.run with Gloo, mpirun, srun) set.
_LAUNCH_VARIABLES = (
    "HOROVOD_RANK",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
)

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


def initialize() -> tuple[int, int]:
    """Initialize Horovod once, with dynamic process sets; return (rank, size).

    Dynamic process sets let several strategies with different meshes be created one
    after another in one process (tests, notebooks); Horovod otherwise fixes its
    process sets at `hvd.init()`.
    """
    hvd = _hvd()
    if not hvd.is_initialized():
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
        hvd.init()
    return hvd.rank(), hvd.size()


def process_set(ranks: Sequence[int]) -> Optional[object]:
    """The Horovod process set of exactly `ranks`, registered on first use.

    Registration is collective: every rank must ask for the same sets in the same order
    (strategies do, since every rank builds the same mesh). Returns the global process
    set for the whole world and None for a single rank (nothing to communicate).
    """
    hvd = _hvd()
    key = tuple(sorted(int(r) for r in ranks))
    if len(key) <= 1:
        return None
    if key == tuple(range(hvd.size())):
        return hvd.global_process_set
    if key not in _process_sets:
        _process_sets[key] = hvd.add_process_set(list(key))
    return _process_sets[key]


def register_process_sets(groups: Sequence[Sequence[int]]) -> None:
    """Register every group in `groups` (collective: all ranks call with the same list)."""
    for group in groups:
        process_set(group)
