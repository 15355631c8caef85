"""Train CosmoFlow on HDF5 universes with spatial (x data) parallelism.

Usage (from the repository root)::

    horovodrun --gloo -np 2 -H localhost:2 python -m recipes.cosmoflow.train \\
        --data data/univ --spatial 2,1,1 --batch-size 2 --epochs 5 --out outputs/cosmoflow
    python -m recipes.cosmoflow.train --data data/univ --spatial 1,1,1 --batch-size 2 --epochs 5

Files DIR/univ_*.h5 (`full` [W, W, W, 4] int16 counts, `unitPar` [4] labels, as written
by tools/write_universes.py) are read as log(1 + counts) (only the corner `--crop`^3 of
each, if given), and the model starts with a fixed per-channel standardization measured on
the first training files (stored in the model). They are split in sorted file order: the first files train, the last `--validation-fraction` of them validate (the same
split on every rank). The model (recipes.cosmoflow.model.build_model) is trained with MSE
and Adam, its gradients averaged over the world; rank 0 writes OUT/model.keras (every
epoch), OUT/history.json and OUT/loss.png and prints the final validation MSE and MAE next
to the MSE of always predicting the mean training label.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from typing import Optional, Sequence

EXIT_BAD_ARGUMENT = 2
# Training universes read to measure the input standardization (per-channel mean, std).
STANDARDIZATION_FILES = 32


def _rank_from_environment() -> int:
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _parse_spatial(text: str) -> tuple[int, int, int]:
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(
            f"must be three positive integers D,H,W (e.g. 2,1,1). Received: --spatial {text!r}"
        )
    return shape


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive integer. Received: {name} {text!r}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(
            f"must be a number strictly between 0 and 1. Received: --validation-fraction {text!r}"
        )
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1). Received: --dropout {text!r}")
    return value


def _learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be a positive number. Received: --learning-rate {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.cosmoflow.train",
        description=(
            "Train the CosmoFlow network on DIR/univ_*.h5 with a spatially split model "
            "(launch with horovodrun; plain python is one rank and needs --spatial 1,1,1)."
        ),
    )
    parser.add_argument("--data", required=True, help="directory holding univ_*.h5 files")
    parser.add_argument("--spatial", type=_parse_spatial, default=(1, 1, 1),
                        help="spatial split D,H,W of each sample over the ranks of a group "
                             "(default 1,1,1); the world size must be a multiple of D*H*W")
    parser.add_argument("--batch-size", type=_positive_int("--batch-size"), required=True,
                        help="GLOBAL batch (samples per step over all ranks); must be a multiple "
                             "of the number of data groups (world size / D*H*W)")
    parser.add_argument("--epochs", type=_positive_int("--epochs"), required=True)
    parser.add_argument("--size", type=_positive_int("--size"), default=None,
                        help="cubic extent W the model is built for (default: the files'; "
                             "must equal it)")
    parser.add_argument("--crop", type=_positive_int("--crop"), default=None,
                        help="train and validate on the corner crop^3 of every universe (e.g. 64 "
                             "of 128^3 files; only the crop is read); default: whole universes")
    parser.add_argument("--no-standardize", dest="standardize", action="store_false",
                        help="feed log(1 + counts) as they are; by default the model starts with "
                             "a fixed per-channel standardization measured on up to "
                             f"{STANDARDIZATION_FILES} training files")
    parser.add_argument("--variant", choices=("paper", "mlperf"), default="paper",
                        help="'paper' (Oyama et al., LBANN) or 'mlperf' (default paper)")
    parser.add_argument("--batch-norm", action="store_true",
                        help="batch normalization after every convolution (global statistics)")
    parser.add_argument("--dropout", type=_rate, default=None,
                        help="dropout rate of the dense head (default: the variant's, 0.2 for "
                             "'paper', 0.5 for 'mlperf'). The head is replicated on the ranks of "
                             "a spatial group; strategy.callbacks aligns their dropout masks, so "
                             "a group draws one mask per sample, as one device would")
    parser.add_argument("--validation-fraction", type=_fraction, default=0.25,
                        help="fraction of the files, the last ones in sorted order, used for "
                             "validation (default 0.25; at least 1 file)")
    parser.add_argument("--learning-rate", type=_learning_rate, default=1e-4,
                        help="Adam learning rate (default 1e-4: the paper's 1e-3 is for batch 64; "
                             "at the small batches of a CPU run 1e-3 only learns the mean label, "
                             "see docs/cosmoflow_claim.md)")
    parser.add_argument("--out", default=os.path.join("outputs", "cosmoflow"),
                        help="output directory for model.keras, history.json, loss.png "
                             "(default outputs/cosmoflow)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and the shuffling (default 0)")
    return parser


class _BadArgument(Exception):
    pass


def split_files(paths: Sequence[str], validation_fraction: float) -> tuple[list, list]:
    """Sorted files -> (train, validation): the last round(fraction * N) files (>= 1)
    validate; at least one file must remain for training."""
    paths = sorted(paths)
    n_val = max(1, int(round(validation_fraction * len(paths))))
    if len(paths) - n_val < 1:
        raise _BadArgument(
            f"{len(paths)} file(s) cannot be split into training and validation files "
            f"(--validation-fraction {validation_fraction} takes {n_val}); write more universes"
        )
    return paths[:-n_val], paths[-n_val:]


def validation_batch_size(n_val: int, batch_size: int, data_size: int) -> tuple[int, bool]:
    """The largest multiple of `data_size` <= max(batch_size, data_size) that divides
    `n_val` (every validation sample seen exactly once), or `data_size` and False when
    none does (the last batch then repeats a few samples)."""
    for b in range(max(batch_size, data_size), 0, -1):
        if b % data_size == 0 and n_val % b == 0:
            return b, True
    return data_size, False


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
        raise _BadArgument(
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


def _plot(history: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    epochs = range(1, len(history["loss"]) + 1)
    for ax, metric, title in ((axes[0], "loss", "MSE"), (axes[1], "mae", "MAE")):
        if metric in history:
            ax.plot(epochs, history[metric], "o-", label="training")
        if "val_" + metric in history:
            ax.plot(epochs, history["val_" + metric], "s-", label="validation")
        ax.set_xlabel("epoch")
        ax.set_ylabel(title)
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    rank0 = _rank_from_environment() == 0
    data_dir = args.data
    if not os.path.isdir(data_dir):
        raise _BadArgument(f"--data {data_dir!r} is not a directory")
    paths = sorted(glob.glob(os.path.join(data_dir, "univ_*.h5")))
    if not paths:
        raise _BadArgument(
            f"no files univ_*.h5 in --data {data_dir!r} "
            "(write some with tools/write_universes.py)"
        )
    train_paths, val_paths = split_files(paths, args.validation_fraction)

    import numpy as np
    import tensorflow as tf

    local_size = int(os.environ.get("HOROVOD_LOCAL_SIZE", "1") or 1)
    if local_size > 1:  # ranks share this machine's cores
        tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // local_size))
        tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    import keras_spatial as ks
    from recipes.cosmoflow.model import build_model

    try:
        strategy = ks.SpatialStrategy(spatial_shape=args.spatial)
    except ValueError as error:
        raise _BadArgument(f"--spatial {','.join(map(str, args.spatial))}: {error}") from None
    if args.batch_size % strategy.data_size:
        raise _BadArgument(
            f"--batch-size {args.batch_size} (global) must be a multiple of the number of data "
            f"groups, {strategy.data_size} (= world size {strategy.size} / spatial "
            f"{int(np.prod(args.spatial))})"
        )
    if len(train_paths) < args.batch_size:
        raise _BadArgument(
            f"{len(train_paths)} training file(s) is fewer than one global batch "
            f"(--batch-size {args.batch_size}); write more universes or lower --batch-size"
        )

    crop = None
    if args.crop is not None:
        stored = ks.data.HDF5Dataset(train_paths[:1], x="full", y="unitPar").sample_shape
        if args.crop > min(stored[:3]):
            raise _BadArgument(f"--crop {args.crop} is larger than the universes, {stored[:3]}")
        crop = (slice(0, args.crop),) * 3
    train_files = ks.data.HDF5Dataset(train_paths, x="full", y="unitPar", preprocess=np.log1p, crop=crop)
    val_files = ks.data.HDF5Dataset(val_paths, x="full", y="unitPar", preprocess=np.log1p, crop=crop)
    shape = train_files.sample_shape
    if not (shape[0] == shape[1] == shape[2]):
        raise _BadArgument(f"the universes must be cubic. Received: sample shape {shape}")
    if args.size is not None and args.size != shape[0]:
        raise _BadArgument(
            f"--size {args.size} but the files hold {shape[0]}^3 universes"
            + (f" (--crop {args.crop})" if crop else "")
        )
    if val_files.sample_shape != shape:
        raise _BadArgument(
            f"training and validation files differ in shape: {shape} vs {val_files.sample_shape}"
        )
    size = shape[0]

    keras.utils.set_random_seed(args.seed)
    val_batch, exact = validation_batch_size(len(val_paths), args.batch_size, strategy.data_size)
    train_ds = strategy.distribute_dataset(train_files, batch_size=args.batch_size, shuffle=True,
                                           seed=args.seed, drop_remainder=True)
    val_ds = strategy.distribute_dataset(val_files, batch_size=val_batch, shuffle=False,
                                         drop_remainder=False)
    dropout = args.dropout
    if dropout is None:
        from recipes.cosmoflow.model import MLPERF_DROPOUT, PAPER_DROPOUT

        dropout = PAPER_DROPOUT if args.variant == "paper" else MLPERF_DROPOUT
    input_mean = input_std = None
    if args.standardize:
        input_mean, input_std = input_statistics(train_files)
    try:
        with strategy.scope():
            model = build_model(size, variant=args.variant, channels=shape[3],
                                batch_norm=args.batch_norm, dropout=dropout,
                                input_mean=input_mean, input_std=input_std)
    except ValueError as error:
        raise _BadArgument(str(error)) from None
    model.compile(
        optimizer=strategy.distribute_optimizer(keras.optimizers.Adam(args.learning_rate)),
        loss="mse",
        metrics=["mae"],
    )

    out = os.path.abspath(args.out)
    if rank0:
        os.makedirs(out, exist_ok=True)
        print(
            f"cosmoflow.train: {strategy.size} rank(s), spatial {args.spatial}, "
            f"{strategy.data_size} data group(s); {args.variant} model at {size}^3 "
            f"({model.count_params():,} parameters); {len(train_paths)} training and "
            f"{len(val_paths)} validation universes; global batch {args.batch_size} "
            f"(validation {val_batch}); {args.epochs} epoch(s) -> {out}",
            flush=True,
        )
    strategy.barrier()

    epoch_times: list = []

    class _Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_times.append(time.perf_counter() - self._start)

    model_path = os.path.join(out, "model.keras")
    start = time.perf_counter()
    history = model.fit(
        train_ds,
        validation_data=val_ds,
        epochs=args.epochs,
        shuffle=False,
        callbacks=strategy.callbacks(keras.callbacks.ModelCheckpoint(model_path)) + [_Timer()],
        verbose=2 if rank0 else 0,
    )
    fit_seconds = time.perf_counter() - start
    strategy.barrier()

    hist = {k: [float(v) for v in vals] for k, vals in history.history.items()}
    steps = len(train_paths) // args.batch_size
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
        record = {
            "history": hist,
            "summary": summary,
            "config": {
                "data": os.path.abspath(data_dir), "size": size, "crop": args.crop,
                "input_mean": input_mean, "input_std": input_std, "variant": args.variant,
                "spatial": list(args.spatial), "world_size": strategy.size,
                "data_groups": strategy.data_size, "batch_size": args.batch_size,
                "validation_batch_size": val_batch, "epochs": args.epochs,
                "learning_rate": args.learning_rate, "dropout": dropout,
                "batch_norm": args.batch_norm, "seed": args.seed,
                "train_files": [os.path.basename(p) for p in train_paths],
                "validation_files": [os.path.basename(p) for p in val_paths],
                "parameters": int(model.count_params()),
            },
            "outputs": {"model": model_path, "history": os.path.join(out, "history.json"),
                        "plot": os.path.join(out, "loss.png")},
        }
        with open(os.path.join(out, "history.json"), "w") as f:
            json.dump(record, f, indent=2)
        _plot(hist, os.path.join(out, "loss.png"))
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
        print(f"fit took {fit_seconds:.1f} s; {per_step}", flush=True)
        print(f"wrote {model_path}, {record['outputs']['history']}, {record['outputs']['plot']}",
              flush=True)
    strategy.barrier()
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run(args)
    except _BadArgument as error:
        if _rank_from_environment() == 0:
            print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
        return EXIT_BAD_ARGUMENT
    return 0


if __name__ == "__main__":
    sys.exit(main())
