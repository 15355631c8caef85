"""Writes a synthetic CosmoFlow data set: one lognormal universe per HDF5 file.

Usage (from the repository root)::

    python tools/write_universes.py --out data/univ --count 64 --size 128 --seed 1
    horovodrun -np 4 python tools/write_universes.py --out data/univ --count 64 --size 128

Sample i goes to DIR/univ_{i:06d}.h5 and depends only on (seed, i): any number of worker
processes (--workers) or horovodrun ranks (rank r writes i = r, r + size, ...) produce
the same files. Files are written under a hidden temporary name and renamed, complete
files are skipped on a rerun (resume), and files of another data set (other seed, size,
box, ...) are reported instead of overwritten unless --overwrite. Memory: about 35 bytes
per voxel per worker (4.5 GiB at W = 512). Format: see recipes/cosmoflow/universe.py.
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from recipes.cli import int_at_least, non_negative_int, positive_int  # noqa: E402
from recipes.writing import (  # noqa: E402
    check_seed,
    prepare_output_directory,
    resolve_shard,
    write_planned,
)
from recipes.cosmoflow import universe  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="write_universes.py",
        description="Write synthetic lognormal universes (CosmoFlow inputs and labels).",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--count", required=True, type=positive_int("--count"),
                        help="number of universes N; files univ_000000.h5 ... univ_{N-1}")
    parser.add_argument("--size", type=int_at_least("--size", universe.MIN_SIZE), default=128,
                        help="grid points per side W (default 128)")
    parser.add_argument("--seed", type=non_negative_int("--seed"), default=0,
                        help="data set seed (default 0)")
    parser.add_argument("--workers", type=positive_int("--workers"), default=None,
                        help="worker processes (default: available CPUs; 1 under horovodrun)")
    parser.add_argument("--box-size", type=float, default=None,
                        help="box side in Mpc/h (default 4 Mpc/h per cell: 512 at W=128)")
    parser.add_argument("--mean-count", type=float, default=universe.DEFAULT_MEAN_COUNT,
                        help="mean count per cell (default 64)")
    parser.add_argument("--overwrite", action="store_true",
                        help="rewrite every file, even complete ones or other data sets'")
    parser.add_argument("--shard-index", type=non_negative_int("--shard-index"), default=None,
                        help="this writer's shard (default: $HOROVOD_RANK or 0)")
    parser.add_argument("--num-shards", type=positive_int("--num-shards"), default=None,
                        help="number of writers sharing the indices (default: $HOROVOD_SIZE or 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser



def main(argv: Optional[Sequence[str]] = None) -> int:
    """Writes the data set; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_seed(args.seed)
        config = universe.UniverseConfig(
            size=args.size, box_size=args.box_size, mean_count=args.mean_count
        )
        shard, shards = resolve_shard(args.shard_index, args.num_shards)
        out = prepare_output_directory(args.out)
    except ValueError as error:
        parser.error(str(error))
    jobs = [
        universe.UniverseJob(out, args.seed, index, config)
        for index in range(shard, args.count, shards)
    ]
    return write_planned(
        jobs,
        write=universe.write_universe,
        path_of=lambda job: os.path.join(job.directory, universe.universe_filename(job.index)),
        status_of=lambda job: universe.universe_file_status(
            os.path.join(job.directory, universe.universe_filename(job.index)),
            seed=job.seed, index=job.index, config=job.config,
        ),
        overwrite=args.overwrite,
        workers=args.workers,
        quiet=args.quiet,
        label="universes",
        describe=lambda to_write, skipped, workers: (
            f"write_universes: {to_write} to write, {skipped} complete skipped, "
            f"W={config.size}, box={config.box_size:g} Mpc/h, seed={args.seed}, "
            f"workers={workers}, shard {shard}/{shards} -> {out}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
