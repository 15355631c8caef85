"""Writes a synthetic 3D segmentation data set: ellipsoids of two classes in noise.

Usage (from the repository root)::

    python tools/write_segmentation.py --out data/seg --count 256 --size 64,64,64 \\
        --per-file 16 --seed 1

File k is DIR/seg_{k:04d}.h5 and holds samples k*K ... k*K + K - 1 (the last file may
hold fewer); sample j depends only on (seed, j), so any number of worker processes
(--workers) or horovodrun ranks (rank r writes files r, r + size, ...) produce the same
files. Files are written under a hidden temporary name and renamed, complete files are
skipped on a rerun (resume), and files of another data set are reported instead of
overwritten unless --overwrite. Format: see recipes/unet3d/segmentation.py.
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import argparse  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from recipes.cli import extents, non_negative_int, positive_int  # noqa: E402
from recipes.writing import (  # noqa: E402
    check_seed,
    prepare_output_directory,
    resolve_shard,
    write_planned,
)
from recipes.unet3d import segmentation  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="write_segmentation.py",
        description="Write a synthetic 3D segmentation set (ellipsoids of 2 classes in noise).",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--count", required=True, type=positive_int("--count"),
                        help="total number of samples")
    parser.add_argument("--size", type=extents("--size", segmentation.MIN_EXTENT, cube=True), default=(64, 64, 64),
                        help="volume extent D,H,W or W (default 64,64,64)")
    parser.add_argument("--per-file", type=positive_int("--per-file"), default=16,
                        help="samples per file K (default 16)")
    parser.add_argument("--seed", type=non_negative_int("--seed"), default=0,
                        help="data set seed (default 0)")
    parser.add_argument("--workers", type=positive_int("--workers"), default=None,
                        help="worker processes (default: available CPUs; 1 under horovodrun)")
    parser.add_argument("--noise-std", type=float, default=0.5,
                        help="std of the additive noise (default 0.5)")
    parser.add_argument("--blur-sigma", type=float, default=1.0,
                        help="Gaussian blur in voxels (default 1.0)")
    parser.add_argument("--overwrite", action="store_true",
                        help="rewrite every file, even complete ones or other data sets'")
    parser.add_argument("--shard-index", type=non_negative_int("--shard-index"), default=None,
                        help="this writer's shard (default: $HOROVOD_RANK or 0)")
    parser.add_argument("--num-shards", type=positive_int("--num-shards"), default=None,
                        help="number of writers sharing the files (default: $HOROVOD_SIZE or 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Writes the data set; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_seed(args.seed)
        config = segmentation.SegmentationConfig(
            shape=args.size, noise_std=args.noise_std, blur_sigma=args.blur_sigma
        )
        shard, shards = resolve_shard(args.shard_index, args.num_shards)
        out = prepare_output_directory(args.out)
    except ValueError as error:
        parser.error(str(error))
    jobs = segmentation.segmentation_jobs(
        out, seed=args.seed, count=args.count, per_file=args.per_file, config=config
    )[shard::shards]
    return write_planned(
        jobs,
        write=segmentation.write_segmentation,
        path_of=lambda job: job.path,
        status_of=segmentation.segmentation_file_status,
        overwrite=args.overwrite,
        workers=args.workers,
        quiet=args.quiet,
        label="files",
        describe=lambda to_write, skipped, workers: (
            f"write_segmentation: {to_write} files to write, {skipped} complete skipped, "
            f"{args.count} samples of {'x'.join(map(str, config.shape))}, "
            f"{args.per_file} per file, seed={args.seed}, workers={workers}, "
            f"shard {shard}/{shards} -> {out}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
