"""Train the 3D U-Net on HDF5 segmentation volumes with spatial (x data) parallelism.

Usage (from the repository root)::

    horovodrun --gloo -np 2 -H localhost:2 python -m recipes.unet3d.train \\
        --data data/seg --spatial 2,1,1 --batch-size 2 --epochs 5 --out outputs/unet3d
    python -m recipes.unet3d.train --data data/seg --batch-size 2 --epochs 5

Files DIR/seg_*.h5 (`images` [N, D, H, W, 1] float32, `labels` [N, D, H, W] uint8, as
written by tools/write_segmentation.py) are split in sorted file order: the first files
train, the last `--validation-fraction` of them validate (the same split on every rank).
Each rank reads only its sub-volume of each sample and of its label volume.

The model (`recipes.unet3d.model.build_model`) is trained with per-voxel categorical
cross-entropy (the mean over a rank's voxels; every rank holds as many voxels, so the
world average of those means is the global mean) and Adam (`keras_spatial.FusedAdam`),
gradients averaged over the world. The metrics are GLOBAL Dice scores,
2|P n G| / (|P| + |G|) on the argmax, per class (`dice_0` background, `dice_1`, ...) and
averaged over the foreground classes (`dice`), computed from a confusion matrix of voxel
counts: see `recipes.unet3d.model.DiceScore`.

Rank 0 writes OUT/model.keras (every epoch), OUT/history.json, OUT/loss.png, and for
every validation file seg_XXXX.h5 a file OUT/predictions/pred_XXXX.h5 with datasets
`labels` [N, D, H, W] uint8 (the argmax) and `probabilities` [N, D, H, W, classes]
float32, in the input file's sample order. It prints the final validation Dice next to
two baselines without learning: predicting background everywhere, and thresholding the
image at the midpoints between the class intensities stored in the files; history.json
also holds the Dice recomputed from the written predictions (`predictions_dice`), which
equals the last `val_dice` when every validation sample is seen once per validation.

model.keras is a whole-volume model in one process. It is saved compiled, with the
`DiceScore` metrics, so load it after `import recipes.unet3d.model` (which registers
them), or with `keras.saving.load_model(path, compile=False)` after `import keras_spatial`
alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np

from recipes import cli, training

FILE_PATTERN = "seg_*.h5"
PREDICTIONS_DIR = "predictions"


# Arguments --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="python -m recipes.unet3d.train",
        description=(
            "Train the 3D U-Net on DIR/seg_*.h5 with a spatially split model (launch with "
            "horovodrun; plain python is one rank and needs --spatial 1,1,1)."
        ),
    )
    cli.add_data_arguments(parser, FILE_PATTERN)
    parser.add_argument("--depth", type=cli.positive_int("--depth"), default=3,
                        help="number of 2x poolings (default 3, the paper's); every extent must "
                             "be divisible by 2**depth, and the bottom extent at least the split")
    parser.add_argument("--base-filters", type=cli.positive_int("--base-filters"), default=32,
                        help="filters of the first convolution, doubled per level (default 32, "
                             "the paper's)")
    parser.add_argument("--no-batch-norm", dest="batch_norm", action="store_false",
                        help="no batch normalization (default: after every 3^3 convolution, "
                             "statistics over the global batch)")
    cli.add_training_arguments(
        parser,
        learning_rate=1e-3,
        learning_rate_help="Adam learning rate (default 1e-3, as in the paper)",
        out=os.path.join("outputs", "unet3d"),
        out_help="output directory (default outputs/unet3d)",
    )
    return parser


def split_files(paths: Sequence[str], validation_fraction: float) -> tuple[list, list]:
    """Sorted segmentation files -> (train, validation), as `recipes.training.split_files`.

    Raises:
        recipes.cli.BadArgument: with fewer than two files.
    """
    return training.split_files(
        paths, validation_fraction,
        remedy="write the data with a smaller --per-file so that there are several files",
    )


def prediction_filename(input_path: str) -> str:
    """pred_XXXX.h5 for an input file seg_XXXX.h5 (pred_<name> for other names)."""
    name = os.path.basename(input_path)
    return "pred_" + (name[len("seg_"):] if name.startswith("seg_") else name)


# Outputs ----------------------------------------------------------------------------
def write_predictions(model, strategy, paths: Sequence[str], out_dir: str,
                      per_group_batch: int, classes: int) -> np.ndarray:
    """Predicts every sample of `paths` and has rank 0 write OUT/pred_XXXX.h5 files.

    All ranks must call it. Each step, data group g predicts `per_group_batch` samples
    (each rank reading and predicting only its sub-volume), the spatial group gathers
    the probability volumes (`strategy.gather`), and a sum over the data groups, each
    contributing its own slot and zeros elsewhere, gives every rank the step's samples
    in file order. Rank 0 writes them, `labels` (argmax, uint8) and `probabilities`
    (float32), and counts (true, predicted) voxels against the file's `labels`.

    Returns:
        On rank 0 the `[classes, classes]` confusion matrix of all predicted voxels
        (zeros on the other ranks).
    """
    import keras_spatial as ks
    from recipes.writing import atomic_h5_file
    from recipes.unet3d.model import confusion_matrix

    groups, group = strategy.data_size, strategy.data_index
    step = groups * per_group_batch
    confusion = np.zeros((classes, classes))
    rank0 = strategy.rank == 0
    if rank0:
        os.makedirs(out_dir, exist_ok=True)
    for path in paths:
        images = ks.data.HDF5Dataset(path, x="images")
        count, shape = len(images), images.sample_shape
        local = strategy.local_shape((None,) + tuple(shape))[1:4]
        region = tuple(slice(c * n, (c + 1) * n) for c, n in zip(strategy.coords, local))
        target = os.path.join(out_dir, prediction_filename(path))
        with contextlib.ExitStack() as files:
            if rank0:
                h5 = files.enter_context(atomic_h5_file(target))
                # The same open function as the reader's (HDF5 refuses a second handle
                # on a file opened with other close settings).
                truth = files.enter_context(ks.data.open_hdf5(path))["labels"]
                labels_out = h5.create_dataset("labels", (count,) + shape[:3], np.uint8)
                probabilities_out = h5.create_dataset(
                    "probabilities", (count,) + shape[:3] + (classes,), np.float32)
                h5.attrs["source"] = os.path.abspath(path)
                h5.attrs["num_classes"] = classes
            for start in range(0, count, step):
                first = start + group * per_group_batch
                mine = [min(first + j, count - 1) for j in range(per_group_batch)]
                x = np.stack([images.read(i, region)[0] for i in mine])
                volume = strategy.gather(model.predict_on_batch(x)).numpy()
                if groups > 1:
                    slots = np.zeros((groups,) + volume.shape, np.float32)
                    slots[group] = volume
                    volume = strategy.allreduce(slots, "sum", "data").numpy()
                    volume = volume.reshape((step,) + volume.shape[2:])
                if rank0:
                    stop = min(start + step, count)
                    probabilities = volume[: stop - start]
                    predicted = np.argmax(probabilities, axis=-1).astype(np.uint8)
                    probabilities_out[start:stop] = probabilities
                    labels_out[start:stop] = predicted
                    for position, index in enumerate(range(start, stop)):
                        confusion += confusion_matrix(truth[index], predicted[position], classes)
    return confusion


def _baselines(paths: Sequence[str], classes: int) -> dict:
    """Dice of two predictors without learning on the files `paths` (rank 0 only):
    background everywhere, and the image thresholded at the midpoints between the
    class intensities of the file attributes (if present)."""
    from keras_spatial.data import open_hdf5
    from recipes.unet3d.model import confusion_matrix, dice_from_confusion

    background, threshold = np.zeros((classes, classes)), np.zeros((classes, classes))
    have_intensities = True
    for path in paths:
        with open_hdf5(path) as f:
            intensities = f.attrs.get("intensities")
            for index in range(f["labels"].shape[0]):
                truth = f["labels"][index]
                background[:, 0] += np.bincount(truth.ravel(), minlength=classes)[:classes]
                if intensities is None or len(intensities) != classes:
                    have_intensities = False
                    continue
                order = np.argsort(intensities)
                edges = (np.asarray(intensities)[order][1:] + np.asarray(intensities)[order][:-1]) / 2
                predicted = order[np.digitize(f["images"][index][..., 0], edges)]
                threshold += confusion_matrix(truth, predicted, classes)
    result = {"all_background": dice_from_confusion(background)}
    if have_intensities:
        result["intensity_threshold"] = dice_from_confusion(threshold)
    return result


def _dice_text(dice: Sequence[float]) -> str:
    per_class = ", ".join(f"{c}: {d:.4f}" for c, d in enumerate(dice))
    return f"mean foreground {float(np.mean(dice[1:])):.4f} (per class {per_class})"


# Training ---------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    """Trains, writes the outputs and returns rank 0's summary ({} on other ranks).

    Raises:
        cli.BadArgument: for arguments or data that cannot be used (on every rank).
    """
    rank0 = cli.rank_from_environment() == 0
    paths = training.find_data_files(args.data, FILE_PATTERN, "tools/write_segmentation.py")
    train_paths, val_paths = split_files(paths, args.validation_fraction)

    import keras_spatial as ks
    from recipes.unet3d.model import build_model, dice_from_confusion, dice_metrics
    from recipes.unet3d.segmentation import NUM_CLASSES

    try:
        train_files = ks.data.HDF5Dataset(train_paths, x="images", y="labels", y_dtype="int32")
        val_files = ks.data.HDF5Dataset(val_paths, x="images", y="labels", y_dtype="int32")
    except (ks.data.InvalidDataError, ks.data.UnreadableFileError) as error:
        raise cli.BadArgument(str(error)) from None
    shape = train_files.sample_shape
    if val_files.sample_shape != shape:
        raise cli.BadArgument(
            f"training and validation files differ in shape: {shape} vs {val_files.sample_shape}"
        )
    if not train_files.y_sharded or train_files.label_shape != shape[:3]:
        raise cli.BadArgument(
            f"`labels` must hold one (D, H, W) label volume per sample of shape {shape[:3]}. "
            f"Received: label shape {train_files.label_shape}"
        )
    if len(train_files) < args.batch_size:
        raise cli.BadArgument(
            f"{len(train_files)} training sample(s) is fewer than one global batch "
            f"(--batch-size {args.batch_size}); write more samples or lower --batch-size"
        )
    with ks.data.open_hdf5(paths[0]) as f:
        classes = int(f.attrs.get("num_classes", NUM_CLASSES))

    def build():
        return build_model(shape, classes=classes, depth=args.depth,
                           base_filters=args.base_filters, batch_norm=args.batch_norm)

    spatial = args.spatial
    if spatial == "auto":
        try:
            spatial, _ = training.choose_layout(build, args.batch_size, args.hardware, args.memory_limit)
        except ValueError as error:  # the model itself cannot be built
            raise cli.BadArgument(str(error)) from None
    strategy = training.spatial_strategy(spatial, args.batch_size)
    import keras

    keras.utils.set_random_seed(args.seed)
    val_batch, exact = training.validation_batch_size(len(val_files), args.batch_size, strategy.data_size)
    try:
        train_ds = strategy.distribute_dataset(train_files, batch_size=args.batch_size,
                                               shuffle=True, seed=args.seed, drop_remainder=True)
        val_ds = strategy.distribute_dataset(val_files, batch_size=val_batch, shuffle=False,
                                             drop_remainder=False)
        with strategy.scope():
            model = build()
    except (ValueError, ks.data.InvalidDataError) as error:
        raise cli.BadArgument(str(error)) from None
    model.compile(
        optimizer=strategy.distribute_optimizer(ks.FusedAdam(args.learning_rate)),
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=dice_metrics(classes),
    )

    out = os.path.abspath(args.out)
    if rank0:
        os.makedirs(out, exist_ok=True)
        print(
            f"unet3d.train: {strategy.size} rank(s), spatial {strategy.spatial_shape}, "
            f"{strategy.data_size} data group(s); U-Net depth {args.depth}, base filters "
            f"{args.base_filters}, batch norm {'on' if args.batch_norm else 'off'} at "
            f"{'x'.join(map(str, shape[:3]))}x{shape[3]} ({model.count_params():,} parameters); "
            f"{len(train_files)} training samples in {len(train_paths)} file(s), "
            f"{len(val_files)} validation samples in {len(val_paths)} file(s); global batch "
            f"{args.batch_size} (validation {val_batch}); {args.epochs} epoch(s) -> {out}",
            flush=True,
        )
    strategy.barrier()

    model_path = os.path.join(out, "model.keras")
    hist, epoch_times, fit_seconds = training.fit(model, strategy, train_ds, val_ds, args.epochs, model_path)

    predictions_dir = os.path.join(out, PREDICTIONS_DIR)
    start = time.perf_counter()
    confusion = write_predictions(model, strategy, val_paths, predictions_dir,
                                  val_batch // strategy.data_size, classes)
    predict_seconds = time.perf_counter() - start
    strategy.barrier()

    summary: dict = {}
    if rank0:
        baselines = _baselines(val_paths, classes)
        prediction_dice = dice_from_confusion(confusion)
        val_dice = [hist[f"val_dice_{c}"][-1] for c in range(classes)]
        summary = {
            "final_val_dice": hist["val_dice"][-1],
            "final_val_dice_per_class": val_dice,
            "final_val_loss": hist["val_loss"][-1],
            "final_train_loss": hist["loss"][-1],
            "predictions_dice": float(np.mean(prediction_dice[1:])),
            "predictions_dice_per_class": prediction_dice.tolist(),
            "baseline_dice": {k: float(np.mean(v[1:])) for k, v in baselines.items()},
            "baseline_dice_per_class": {k: v.tolist() for k, v in baselines.items()},
            "fit_seconds": fit_seconds,
            "predict_seconds": predict_seconds,
            "epoch_seconds": epoch_times,  # the first includes tracing
            "train_steps_per_epoch": len(train_files) // args.batch_size,
            "validation_exact": exact,
        }
        prediction_files = [os.path.join(predictions_dir, prediction_filename(p)) for p in val_paths]
        config = {
            "data": os.path.abspath(args.data), "shape": list(shape), "classes": classes,
            "depth": args.depth, "base_filters": args.base_filters,
            "batch_norm": args.batch_norm,
            **training.run_config(args, strategy, val_batch, train_paths, val_paths, model),
        }
        record = training.write_history(out, hist, summary, config,
                                   (("loss", "cross-entropy"), ("dice", "mean foreground Dice")),
                                   predictions=prediction_files)
        print(f"final validation Dice: {_dice_text(val_dice)}"
              + ("" if exact else "  (last validation batch repeats samples)"), flush=True)
        for label, dice in baselines.items():
            print(f"  baseline {label.replace('_', '-')}: {_dice_text(dice)}", flush=True)
        print(f"fit took {fit_seconds:.1f} s (epochs: "
              f"{', '.join(f'{t:.1f}' for t in epoch_times)} s; the first includes tracing); "
              f"predictions {predict_seconds:.1f} s", flush=True)
        print(f"wrote {model_path}, {record['outputs']['history']}, {record['outputs']['plot']}, "
              f"{len(prediction_files)} prediction file(s) in {predictions_dir}", flush=True)
    strategy.barrier()
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parses `argv`, trains; returns the process exit status (2 for bad arguments)."""
    return cli.run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
