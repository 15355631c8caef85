"""Command-line pieces shared by the training recipes and the tools.

`recipes.cosmoflow.train`, `recipes.unet3d.train`, the data set writers in tools/ and the
benchmarks build their interfaces from these:

- argparse types: `spatial_shape` (the `--spatial D,H,W` split), `extents` (any three
  extents, e.g. a volume size), `int_at_least` and its presets `positive_int` and
  `non_negative_int`, `bounded_float` and its presets `fraction`, `rate` and
  `positive_float`. Each names its flag in its error message, e.g. "must be a positive
  integer. Received: --epochs '0'".
- `add_data_arguments` and `add_training_arguments`: the options every trainer has
  (--data, --spatial, --batch-size, --epochs first; --validation-fraction,
  --learning-rate, --out, --seed last).
- `BadArgument`, `EXIT_BAD_ARGUMENT` and `run_main`: arguments or data found unusable
  after parsing are reported as `PROG: error: MESSAGE` on rank 0 with exit status 2, as
  argparse reports its own errors.
- `rank_from_environment`: the rank of this process under horovodrun or mpirun, before
  Horovod is initialized.

The training harness the trainers run after parsing is `recipes.training`. Only the
standard library is imported here.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Optional, Sequence

EXIT_BAD_ARGUMENT = 2
# Environment variables holding this process's rank (Horovod, Open MPI, MPICH/Intel MPI).
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


class BadArgument(Exception):
    """An argument or input data that cannot be used, found after parsing.

    `run_main` prints its message as the command's error and exits with status
    `EXIT_BAD_ARGUMENT`.
    """


def rank_from_environment() -> int:
    """Returns this process's rank as set by the launcher (0 when not launched).

    Reads the first of `RANK_VARIABLES` that holds a whole number, so that it works
    before (or without) Horovod's initialization.
    """
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def world_size_from_environment() -> int:
    """Returns the number of ranks the launcher started (1 when not launched).

    Reads the first of `SIZE_VARIABLES` that holds a whole number, so that it works
    before (or without) Horovod's initialization.
    """
    for name in SIZE_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


# argparse types ------------------------------------------------------------------------
def extents(flag: str, minimum: int = 1, what: Optional[str] = None,
            cube: bool = False) -> Callable[[str], tuple]:
    """Returns an argparse type for three integer extents 'D,H,W' (or 'DxHxW').

    Args:
        flag: the option's name, e.g. '--size', quoted in the error message.
        minimum: the smallest extent allowed. Defaults to 1.
        what: the allowed values in words, for the error message "must be WHAT.
            Received: FLAG 'TEXT'". Defaults to "three integers D,H,W of at least
            MINIMUM" (with "(or one W for a cube)" when `cube`).
        cube: whether a single number W also means (W, W, W). Defaults to False.

    Returns:
        A function of the argument's text returning the tuple (D, H, W).
    """
    if what is None:
        what = f"three integers D,H,W of at least {minimum}" + (" (or one W for a cube)" if cube else "")

    def parse(text: str) -> tuple[int, int, int]:
        parts = text.replace("x", ",").split(",")
        if cube and len(parts) == 1:
            parts = parts * 3
        try:
            shape = tuple(int(part) for part in parts)
        except ValueError:
            shape = ()
        if len(shape) != 3 or any(s < minimum for s in shape):
            raise argparse.ArgumentTypeError(f"must be {what}. Received: {flag} {text!r}")
        return shape

    return parse


_spatial_shape = extents("--spatial", 1, "three positive integers D,H,W (e.g. 2,1,1)")


def spatial_shape(text: str) -> tuple[int, int, int]:
    """argparse type of `--spatial D,H,W` (',' or 'x' between the numbers).

    Raises:
        argparse.ArgumentTypeError: "must be three positive integers D,H,W (e.g. 2,1,1).
            Received: --spatial 'TEXT'", unless `text` is three positive integers.
    """
    return _spatial_shape(text)


def spatial_layout(text: str):
    """argparse type of `--spatial`: 'auto', or three positive integers D,H,W.

    Returns:
        "auto", or the shape as for `spatial_shape`.
    """
    return "auto" if text.strip().lower() == "auto" else _spatial_shape(text)


def positive_int(flag: str) -> Callable[[str], int]:
    """Returns an argparse type for an integer >= 1 given to the option `flag`.

    Args:
        flag: the option's name, e.g. '--epochs', quoted in the error message.
    """
    return int_at_least(flag, 1, "a positive integer")


def non_negative_int(flag: str) -> Callable[[str], int]:
    """Returns an argparse type for an integer >= 0 given to the option `flag`."""
    return int_at_least(flag, 0, "a non-negative integer")


def int_at_least(flag: str, low: int, what: Optional[str] = None) -> Callable[[str], int]:
    """Returns an argparse type for an integer >= `low` given to the option `flag`.

    Args:
        flag: the option's name, quoted in the error message.
        low: the smallest value allowed.
        what: the allowed values in words, for the error message "must be WHAT.
            Received: FLAG 'TEXT'". Defaults to "an integer of at least LOW".
    """
    what = what or f"an integer of at least {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}. Received: {flag} {text!r}")
        return value

    return parse


def int_list(flag: str, low: int = 1, high: Optional[int] = None) -> Callable[[str], list]:
    """Returns an argparse type for comma-separated integers in [low, high], e.g. '32,64'.

    Args:
        flag: the option's name, quoted in the error message.
        low: the smallest value allowed. Defaults to 1.
        high: the largest value allowed, or None for no bound. Defaults to None.

    Returns:
        A function of the argument's text returning the sorted list of distinct values.
    """
    what = f"comma-separated integers of at least {low}" + (f" and at most {high}" if high is not None else "")

    def parse(text: str) -> list:
        try:
            values = sorted({int(part) for part in text.split(",")})
        except ValueError:
            values = []
        if not values or values[0] < low or (high is not None and values[-1] > high):
            raise argparse.ArgumentTypeError(f"must be {what}. Received: {flag} {text!r}")
        return values

    return parse


def bounded_float(flag: str, what: str, low: float, high: float,
                  low_inclusive: bool = False) -> Callable[[str], float]:
    """Returns an argparse type for a number in (low, high), or [low, high).

    Args:
        flag: the option's name, quoted in the error message.
        what: the allowed range in words, e.g. 'a number in [0, 1)'; the error message
            is "must be WHAT. Received: FLAG 'TEXT'".
        low: the lower bound, excluded unless `low_inclusive`.
        high: the upper bound, always excluded (math.inf: no bound, but inf itself and
            nan are refused).
        low_inclusive: whether `low` itself is allowed.
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = low <= value if low_inclusive else low < value
        if not (above and value < high):
            raise argparse.ArgumentTypeError(f"must be {what}. Received: {flag} {text!r}")
        return value

    return parse


def fraction(flag: str) -> Callable[[str], float]:
    """argparse type for a number strictly between 0 and 1 (e.g. a validation fraction)."""
    return bounded_float(flag, "a number strictly between 0 and 1", 0.0, 1.0)


def rate(flag: str) -> Callable[[str], float]:
    """argparse type for a number in [0, 1) (e.g. a dropout rate)."""
    return bounded_float(flag, "a number in [0, 1)", 0.0, 1.0, low_inclusive=True)


def positive_float(flag: str) -> Callable[[str], float]:
    """argparse type for a finite number > 0 (e.g. a learning rate)."""
    return bounded_float(flag, "a positive number", 0.0, math.inf)


# Options every training command has ---------------------------------------------------------
def add_data_arguments(parser: argparse.ArgumentParser, pattern: str) -> None:
    """Adds --data, --spatial, --batch-size and --epochs, the first options of a trainer.

    Args:
        parser: the command's parser.
        pattern: the files read from --data, e.g. 'univ_*.h5' (for its help).
    """
    parser.add_argument("--data", required=True, help=f"directory holding {pattern} files")
    parser.add_argument("--spatial", type=spatial_layout, default=(1, 1, 1),
                        help="spatial split D,H,W of each sample over the ranks of a group "
                             "(default 1,1,1); the world size must be a multiple of D*H*W. "
                             "'auto': the fastest layout that fits --memory-limit on --hardware, "
                             "predicted by keras_spatial.cost_model")
    parser.add_argument("--batch-size", type=positive_int("--batch-size"), required=True,
                        help="GLOBAL batch (samples per step over all ranks); must be a multiple "
                             "of the number of data groups (world size / D*H*W)")
    parser.add_argument("--epochs", type=positive_int("--epochs"), required=True)
    parser.add_argument("--hardware", default=None,
                        help="for --spatial auto (required there): a profile of "
                             "keras_spatial.hardware_profiles (lassen, h100, ...) or a JSON file of "
                             "keras_spatial.cost_model.Hardware fields")
    parser.add_argument("--memory-limit", type=positive_float("--memory-limit"), default=None,
                        metavar="GIB", help="for --spatial auto: GiB per rank (default: the "
                                            "hardware's memory)")


def add_training_arguments(parser: argparse.ArgumentParser, learning_rate: float,
                           learning_rate_help: str, out: str, out_help: str) -> None:
    """Adds --validation-fraction, --learning-rate, --out and --seed, the last options.

    Args:
        parser: the command's parser (the model's own options added before).
        learning_rate: the default Adam learning rate.
        learning_rate_help: the help of --learning-rate.
        out: the default output directory.
        out_help: the help of --out.
    """
    parser.add_argument("--validation-fraction", type=fraction("--validation-fraction"), default=0.25,
                        help="fraction of the files, the last ones in sorted order, used for "
                             "validation (default 0.25; at least 1 file)")
    parser.add_argument("--learning-rate", type=positive_float("--learning-rate"),
                        default=learning_rate, help=learning_rate_help)
    parser.add_argument("--out", default=out, help=out_help)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and the shuffling (default 0)")


# Running a command ------------------------------------------------------------------------
def run_main(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], object],
             argv: Optional[Sequence[str]] = None) -> int:
    """Parses `argv` with `parser` and calls `run` on the arguments.

    Args:
        parser: the command's parser; its `prog` starts the error message.
        run: the command; it raises `BadArgument` for arguments or data it cannot use
            (on every rank).
        argv: the arguments (default: sys.argv[1:]).

    Returns:
        The exit status: 0, or `EXIT_BAD_ARGUMENT` after printing
        'PROG: error: MESSAGE' to stderr on rank 0. argparse's own errors exit
        with status 2 from `parse_args`, as usual.
    """
    args = parser.parse_args(argv)
    try:
        run(args)
    except BadArgument as error:
        if rank_from_environment() == 0:
            print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
        return EXIT_BAD_ARGUMENT
    return 0
