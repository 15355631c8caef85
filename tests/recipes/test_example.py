"""The README's first example (examples/spatial_unet.py): a plain Keras script made spatial
by the lines marked `# keras_spatial`, on 2 ranks, ends where the script without them ends
in one process."""

import re

import numpy as np
import pytest

from tests.comparison import excess
from tests.distributed.example_workers import EXAMPLE, load_example, run_example
from tests.distributed.launcher import horovod_or_skip, run_on_ranks

MARK = "# keras_spatial"
EPOCHS = 3


def plain_source() -> str:
    """The example without keras_spatial: marked lines dropped, the marked `fit` given
    the whole arrays and no callbacks."""
    lines = []
    for line in open(EXAMPLE).read().splitlines():
        if not line.rstrip().endswith(MARK):
            lines.append(line)
        elif line.strip().startswith("model.fit("):
            line = line.split(MARK)[0].rstrip()
            line = re.sub(r"strategy\.shard\((\w+)\)", r"\1", line)
            lines.append(line.replace(", callbacks=strategy.callbacks()", ""))
    return "\n".join(lines) + "\n"


def test_the_example_differs_from_plain_keras_by_at_most_four_lines():
    source = open(EXAMPLE).read()
    marked = [line for line in source.splitlines() if line.rstrip().endswith(MARK)]
    assert len(marked) <= 4, marked  # the import, the strategy, spatialize, fit
    plain = plain_source()
    assert "keras_spatial" not in plain.split('"""', 2)[2] and "strategy" not in plain.split('"""', 2)[2]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_example_on_two_ranks_matches_one_process():
    horovod_or_skip()
    per_rank = run_on_ranks(run_example, 2, EPOCHS)
    plain = load_example(plain_source(), name="plain_unet").main(["--epochs", str(EPOCHS)])
    expected = plain.get_weights()
    for rank, weights in enumerate(per_rank):
        assert len(weights) == len(expected)
        worst = max(excess(w, e, 1e-4, 1e-4) for w, e in zip(weights, expected))
        assert worst <= 0, f"rank {rank}: weights differ from one process by {worst}"
    moved = max(float(np.max(np.abs(w - e))) for w, e in zip(per_rank[0], load_example(plain_source(), "fresh").unet().get_weights()))
    assert moved > 0
