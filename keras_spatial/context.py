"""Which `SpatialStrategy` the layers, ops and optimizer of this process use.

The strategy registers itself here when it is created (`set_latest`) and while its
`scope()` is active (`push_scope` / `pop_scope`); everything below the front end reads it
with `get_strategy()`. This module imports nothing of keras_spatial, so layers and ops
depend on it and not on `keras_spatial.strategy`, which imports them.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    from keras_spatial.strategy import SpatialStrategy

_scope_stack: list[Optional["SpatialStrategy"]] = []
_latest: Optional["SpatialStrategy"] = None


def get_strategy() -> Optional["SpatialStrategy"]:
    """The strategy layers use: the innermost `scope()`, else the latest one created.

    Returns None when no strategy exists; spatial layers then behave exactly like their
    Keras parents (a saved model loaded in one process is an ordinary model).
    """
    if _scope_stack:
        return _scope_stack[-1]
    return _latest


def set_latest(strategy: "SpatialStrategy") -> None:
    """Make `strategy` the one used outside any scope (called by its constructor)."""
    global _latest
    _latest = strategy


def push_scope(strategy: "SpatialStrategy") -> None:
    """Enter `strategy.scope()`: it is used until the matching `pop_scope`."""
    _scope_stack.append(strategy)


def pop_scope() -> None:
    """Leave the innermost `scope()`."""
    _scope_stack.pop()


@contextlib.contextmanager
def no_strategy() -> Iterator[None]:
    """Inside it, `get_strategy()` is None: layers and `keras_spatial.Input` build the
    whole-volume model of one process (as `keras_spatial.spatialize` does to check a
    layout before building the model for this rank)."""
    _scope_stack.append(None)
    try:
        yield
    finally:
        _scope_stack.pop()
