"""Train CosmoFlow on HDF5 universes with spatial (x data) parallelism.

Usage (from the repository root)::

    horovodrun --gloo -np 2 -H localhost:2 python -m recipes.cosmoflow.train \\
        --data data/univ --spatial 2,1,1 --batch-size 2 --epochs 5 --out outputs/cosmoflow
    python -m recipes.cosmoflow.train --data data/univ --spatial 1,1,1 --batch-size 2 --epochs 5

Files DIR/univ_*.h5 (`full` [W, W, W, 4] int16 counts, `unitPar` [4] labels, as written
by tools/write_universes.py) are read as log(1 + counts) (only the corner `--crop`^3 of
each, if given), and the model starts with a fixed per-channel standardization measured on
the first training files (stored in the model). They are split in sorted file order: the
first files train, the last `--validation-fraction` of them validate (the same split on
every rank). The model (recipes.cosmoflow.model.build_model) is trained with MSE and Adam
(`keras_spatial.FusedAdam`) or the schedule of `--schedule` (recipes.cosmoflow.schedules),
its gradients averaged over the world, optionally on universes transformed by random
symmetries of the cube (`--augment`, done shard by shard by the input pipeline); rank 0 writes
OUT/model.keras (every epoch), OUT/history.json and OUT/loss.png and prints the final
validation MSE and MAE next to the MSE of always predicting the mean training label.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from recipes import cli, training
from recipes.cosmoflow.model import HEADS
from recipes.cosmoflow.schedules import MLPERF_TARGET_VAL_MAE, SCHEDULES

# Training universes read to measure the input standardization (per-channel mean, std).
STANDARDIZATION_FILES = 32
# The paper variant's blocks from this one on run replicated (see --gather-before-block).
DEFAULT_GATHER_BEFORE_BLOCK = 5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.cosmoflow.train",
        description=(
            "Train the CosmoFlow network on DIR/univ_*.h5 with a spatially split model "
            "(launch with horovodrun; plain python is one rank and needs --spatial 1,1,1)."
        ),
    )
    cli.add_data_arguments(parser, "univ_*.h5")
    parser.add_argument("--size", type=cli.positive_int("--size"), default=None,
                        help="cubic extent W the model is built for (default: the files'; "
                             "must equal it)")
    parser.add_argument("--crop", type=cli.positive_int("--crop"), default=None,
                        help="train and validate on the corner crop^3 of every universe (e.g. 64 "
                             "of 128^3 files; only the crop is read); default: whole universes")
    parser.add_argument("--no-standardize", dest="standardize", action="store_false",
                        help="feed log(1 + counts) as they are; by default the model starts with "
                             "a fixed per-channel standardization measured on up to "
                             f"{STANDARDIZATION_FILES} training files")
    parser.add_argument("--whiten", action="store_true",
                        help="start the model with a fixed whitening of the channels (ZCA, "
                             "recipes.cosmoflow.model.whitening_statistics, measured on the same "
                             "training files) instead of the per-channel standardization: the "
                             "parameters live in the small differences between the redshift "
                             "channels, which it brings to unit scale (docs/cosmoflow_claim.md)")
    parser.add_argument("--variant", choices=("paper", "mlperf"), default="paper",
                        help="'paper' (Oyama et al., LBANN) or 'mlperf' (default paper)")
    parser.add_argument("--gather-before-block", type=int, choices=(0, 2, 3, 4, 5, 6, 7),
                        default=None,
                        help="'paper' only: stop the spatial split before this block and run the "
                             f"rest replicated (default {DEFAULT_GATHER_BEFORE_BLOCK}, where LBANN "
                             "stops it: blocks 5-7 hold 94%% of the conv weights but work on 4^3 "
                             "or smaller volumes at 128^3, so replicating them costs little "
                             "compute and saves their halo exchanges and gradient allreduce); "
                             "0 splits every block")
    parser.add_argument("--head", choices=HEADS, default="flatten",
                        help="input of the dense head: the last volume flattened (the variant's "
                             "own, default), its global average ('gap'), or that average "
                             "batch-normalized ('gap-bn')")
    parser.add_argument("--schedule", choices=SCHEDULES, default="constant",
                        help="'constant': Adam at --learning-rate (default); 'warmup-cosine': "
                             "Adam, linear warm-up over --warmup-epochs to --learning-rate, then "
                             "cosine decay to 1%% of it; 'mlperf': MLPerf HPC's reference (SGD "
                             "momentum 0.9, 0.001 x batch/64, 4 warm-up epochs, x0.25 and x0.125 "
                             "at epochs 32 and 64 of 128, scaled to --epochs; --learning-rate "
                             "is not used)")
    parser.add_argument("--warmup-epochs", type=cli.non_negative_int("--warmup-epochs"), default=1,
                        help="warm-up epochs of --schedule warmup-cosine (default 1)")
    parser.add_argument("--augment", choices=("none", "flips", "cube"), default="none",
                        help="transform every training universe by a random symmetry of the "
                             "cube each epoch ('cube': the 48 rotations and reflections, "
                             "'flips': the 8 reflections), read shard by shard; default none")
    parser.add_argument("--batch-norm", action="store_true",
                        help="batch normalization after every convolution (global statistics)")
    parser.add_argument("--batch-renorm", action="store_true",
                        help="with --batch-norm: batch renormalization (Ioffe 2017) in the trunk, "
                             "training normalizes by clipped-corrected moving statistics")
    parser.add_argument("--recompute-bn-statistics", action="store_true",
                        help="with --batch-norm: before the last validation, replace the moving "
                             "statistics by the average batch statistics of the final weights "
                             "over the training universes (keras_spatial.callbacks."
                             "RecomputeBatchNormStatistics; docs/cosmoflow_claim.md)")
    parser.add_argument("--dropout", type=cli.rate("--dropout"), default=None,
                        help="dropout rate of the dense head (default: the variant's, 0.2 for "
                             "'paper', 0.5 for 'mlperf'). The head is replicated on the ranks of "
                             "a spatial group; strategy.callbacks aligns their dropout masks, so "
                             "a group draws one mask per sample, as one device would")
    cli.add_training_arguments(
        parser,
        learning_rate=1e-4,
        learning_rate_help="Adam learning rate (default 1e-4: the paper's 1e-3 is for batch 64; "
                           "at the small batches of a CPU run 1e-3 only learns the mean label, "
                           "see docs/cosmoflow_claim.md)",
        out=os.path.join("outputs", "cosmoflow"),
        out_help="output directory for model.keras, history.json, loss.png "
                 "(default outputs/cosmoflow)",
    )
    return parser


def split_files(paths: Sequence[str], validation_fraction: float) -> tuple[list, list]:
    """Sorted universe files -> (train, validation), as `recipes.training.split_files`.

    Raises:
        recipes.cli.BadArgument: with fewer than two files.
    """
    return training.split_files(paths, validation_fraction, remedy="write more universes")


def model_options(args: argparse.Namespace) -> tuple:
    """(dropout, gather_before_block) of the model from --dropout, --variant and
    --gather-before-block (the variant's defaults where not given)."""
    from recipes.cosmoflow.model import MLPERF_DROPOUT, PAPER_DROPOUT

    dropout = args.dropout
    if dropout is None:
        dropout = PAPER_DROPOUT if args.variant == "paper" else MLPERF_DROPOUT
    gather_before_block = args.gather_before_block
    if args.variant != "paper":
        if gather_before_block:
            raise cli.BadArgument("--gather-before-block is for --variant paper only")
        gather_before_block = None
    elif gather_before_block is None:
        gather_before_block = DEFAULT_GATHER_BEFORE_BLOCK
    return dropout, gather_before_block or None


def input_statistics(dataset, count: int = None) -> tuple[list, list]:
    """Per-channel mean and standard deviation of the (preprocessed) inputs of the first
    `count` samples of `dataset` (float64 sums; the same on every rank)."""
    import numpy as np

    count = min(len(dataset), count or STANDARDIZATION_FILES)
    total = total_sq = 0.0
    voxels = 0
    for index in range(count):
        x, _ = dataset.read(index)
        x = x.astype(np.float64).reshape(-1, x.shape[-1])
        total = total + x.sum(axis=0)
        total_sq = total_sq + (x * x).sum(axis=0)
        voxels += x.shape[0]
    mean = total / voxels
    std = np.sqrt(np.maximum(total_sq / voxels - mean * mean, 0.0))
    if not np.all(std > 0):
        raise cli.BadArgument(
            f"the inputs of the first {count} training universes are constant in some channel "
            f"(standard deviations {std.tolist()}); use --no-standardize"
        )
    return mean.tolist(), std.tolist()


def _read_labels(paths: Sequence[str]):
    import h5py
    import numpy as np

    labels = []
    for path in paths:
        with h5py.File(path, "r") as f:
            labels.append(np.asarray(f["unitPar"][...], dtype=np.float64))
    return np.stack(labels)


def run(args: argparse.Namespace) -> dict:
    rank0 = cli.rank_from_environment() == 0
    data_dir = args.data
    paths = training.find_data_files(data_dir, "univ_*.h5", "tools/write_universes.py")
    train_paths, val_paths = split_files(paths, args.validation_fraction)

    import numpy as np

    import keras_spatial as ks
    from recipes.cosmoflow.model import build_model, whitening_statistics
    from recipes.cosmoflow.schedules import make_optimizer
    if len(train_paths) < args.batch_size:
        raise cli.BadArgument(
            f"{len(train_paths)} training file(s) is fewer than one global batch "
            f"(--batch-size {args.batch_size}); write more universes or lower --batch-size"
        )

    crop = None
    if args.crop is not None:
        stored = ks.data.HDF5Dataset(train_paths[:1], x="full", y="unitPar").sample_shape
        if args.crop > min(stored[:3]):
            raise cli.BadArgument(f"--crop {args.crop} is larger than the universes, {stored[:3]}")
        crop = (slice(0, args.crop),) * 3
    train_files = ks.data.HDF5Dataset(train_paths, x="full", y="unitPar", preprocess=np.log1p, crop=crop)
    val_files = ks.data.HDF5Dataset(val_paths, x="full", y="unitPar", preprocess=np.log1p, crop=crop)
    shape = train_files.sample_shape
    if not (shape[0] == shape[1] == shape[2]):
        raise cli.BadArgument(f"the universes must be cubic. Received: sample shape {shape}")
    if args.size is not None and args.size != shape[0]:
        raise cli.BadArgument(
            f"--size {args.size} but the files hold {shape[0]}^3 universes"
            + (f" (--crop {args.crop})" if crop else "")
        )
    if val_files.sample_shape != shape:
        raise cli.BadArgument(
            f"training and validation files differ in shape: {shape} vs {val_files.sample_shape}"
        )
    size = shape[0]
    dropout, gather_before_block = model_options(args)
    if args.recompute_bn_statistics and not (args.batch_norm or args.head == "gap-bn"):
        raise cli.BadArgument("--recompute-bn-statistics needs batch normalization "
                              "(--batch-norm or --head gap-bn)")
    if args.batch_renorm and not args.batch_norm:
        raise cli.BadArgument("--batch-renorm renormalizes the trunk's batch norms; add --batch-norm")
    input_mean = input_std = input_whitening = None
    if args.whiten:
        if not args.standardize:
            raise cli.BadArgument("--whiten replaces the standardization; drop --no-standardize")
        count = min(len(train_files), STANDARDIZATION_FILES)
        try:
            input_whitening = whitening_statistics(train_files.read(i)[0] for i in range(count))
        except ValueError as error:
            raise cli.BadArgument(f"--whiten: {error}") from None
    elif args.standardize:
        input_mean, input_std = input_statistics(train_files)

    def build(gather=gather_before_block):
        return build_model(size, variant=args.variant, channels=shape[3], batch_norm=args.batch_norm,
                           dropout=dropout, input_mean=input_mean, input_std=input_std,
                           input_whitening=input_whitening, gather_before_block=gather, head=args.head,
                           batch_renorm=args.batch_renorm)

    spatial = args.spatial
    if spatial == "auto":
        # Where the split stops is part of the layout unless --gather-before-block fixes it.
        variants = {gather_before_block: build}
        if args.variant == "paper" and args.gather_before_block is None:
            variants = {g: (lambda g=g: build(g)) for g in (None, 7, 6, 5, 4, 3)}
        try:
            spatial, gather_before_block = training.choose_layout(
                variants, args.batch_size, args.hardware, args.memory_limit)
        except ValueError as error:  # the model itself cannot be built
            raise cli.BadArgument(str(error)) from None
    strategy = training.spatial_strategy(spatial, args.batch_size)
    import keras

    keras.utils.set_random_seed(args.seed)
    val_batch, exact = training.validation_batch_size(len(val_paths), args.batch_size, strategy.data_size)
    augment = None if args.augment == "none" else args.augment
    train_ds = strategy.distribute_dataset(train_files, batch_size=args.batch_size, shuffle=True,
                                           seed=args.seed, drop_remainder=True, augment=augment)
    val_ds = strategy.distribute_dataset(val_files, batch_size=val_batch, shuffle=False,
                                         drop_remainder=False)
    try:
        with strategy.scope():
            model = build(gather_before_block)
    except ValueError as error:
        raise cli.BadArgument(str(error)) from None
    steps = len(train_paths) // args.batch_size
    optimizer, optimizer_text = make_optimizer(
        args.schedule, args.learning_rate, global_batch=args.batch_size, epochs=args.epochs,
        steps_per_epoch=steps, warmup_epochs=args.warmup_epochs)
    model.compile(
        optimizer=strategy.distribute_optimizer(optimizer),
        loss="mse",
        metrics=["mae"],
    )

    out = os.path.abspath(args.out)
    if rank0:
        os.makedirs(out, exist_ok=True)
        print(
            f"cosmoflow.train: {strategy.size} rank(s), spatial {strategy.spatial_shape}, "
            f"{strategy.data_size} data group(s); {args.variant} model at {size}^3 "
            f"({model.count_params():,} parameters); {len(train_paths)} training and "
            f"{len(val_paths)} validation universes; global batch {args.batch_size} "
            f"(validation {val_batch}); {args.epochs} epoch(s); {optimizer_text}"
            f"{'; augment ' + augment if augment else ''} -> {out}",
            flush=True,
        )
    strategy.barrier()

    model_path = os.path.join(out, "model.keras")
    extra_callbacks = []
    if args.recompute_bn_statistics:
        # A dataset of its own: iterating train_ds would move its epoch counter on.
        stats_ds = strategy.distribute_dataset(train_files, batch_size=args.batch_size, shuffle=False,
                                               drop_remainder=True)
        extra_callbacks.append(ks.callbacks.RecomputeBatchNormStatistics(stats_ds))
    hist, epoch_times, fit_seconds = training.fit(model, strategy, train_ds, val_ds, args.epochs, model_path,
                                                  callbacks=extra_callbacks)
    strategy.barrier()

    summary = {}
    if rank0:
        train_labels = _read_labels(train_paths)
        val_labels = _read_labels(val_paths)
        mean_label = train_labels.mean(axis=0)
        baseline_mse = float(np.mean((val_labels - mean_label) ** 2))
        baseline_mae = float(np.mean(np.abs(val_labels - mean_label)))
        summary = {
            "final_val_mse": hist["val_loss"][-1],
            "final_val_mae": hist["val_mae"][-1],
            "final_train_mse": hist["loss"][-1],
            "baseline_val_mse": baseline_mse,
            "baseline_val_mae": baseline_mae,
            "fit_seconds": fit_seconds,
            # the first epoch includes tracing/graph building
            "epoch_seconds": epoch_times,
            "train_steps_per_epoch": steps,
            "validation_exact": exact,
        }
        config = {
            "data": os.path.abspath(data_dir), "size": size, "crop": args.crop,
            "input_mean": input_mean, "input_std": input_std, "input_whitening": input_whitening, "variant": args.variant,
            "dropout": dropout, "batch_norm": args.batch_norm,
            "batch_renorm": args.batch_renorm, "head": args.head,
            "recompute_bn_statistics": args.recompute_bn_statistics,
            "schedule": args.schedule, "optimizer": optimizer_text, "augment": augment,
            "gather_before_block": gather_before_block,
            **training.run_config(args, strategy, val_batch, train_paths, val_paths, model),
        }
        record = training.write_history(out, hist, summary, config, (("loss", "MSE"), ("mae", "MAE")))
        per_step = (
            f"{min(epoch_times[1:]) / steps:.2f} s/training step (epochs after the first, incl. "
            "validation)" if len(epoch_times) > 1 else f"{epoch_times[0]:.1f} s first epoch"
        )
        print(
            f"final validation MSE {summary['final_val_mse']:.5f}  MAE {summary['final_val_mae']:.5f}"
            f"  | mean-training-label predictor: MSE {baseline_mse:.5f}  MAE {baseline_mae:.5f}"
            + ("" if exact else "  (last validation batch repeats samples)"),
            flush=True,
        )
        if args.schedule == "mlperf":
            print(f"MLPerf HPC's target validation MAE: {MLPERF_TARGET_VAL_MAE} (its full data set "
                  f"and 128 epochs); this run: {summary['final_val_mae']:.4f}", flush=True)
        print(f"fit took {fit_seconds:.1f} s; {per_step}", flush=True)
        print(f"wrote {model_path}, {record['outputs']['history']}, {record['outputs']['plot']}",
              flush=True)
    strategy.barrier()
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parses `argv`, trains; returns the exit status (2 for bad arguments)."""
    return cli.run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
