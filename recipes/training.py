"""The training harness of the recipes' trainers, after their arguments are parsed.

- `spatial_strategy`: the strategy of `--spatial` (threads limited when ranks share the
  machine, `limit_threads`); `choose_layout`: the layout of `--spatial auto`
  (`keras_spatial.cost_model.auto_layout`).
- `find_data_files`, `split_files` and `validation_batch_size`: the files of `--data`,
  their split into training and validation files, and the validation batch.
- `fit`: a timed `model.fit` that saves the model every epoch.
- `run_config`, `write_history` and `plot_history`: OUT/history.json (history, summary,
  settings, output files) and the training and validation curves OUT/loss.png.

Errors in arguments or data raise `recipes.cli.BadArgument`. TensorFlow, Keras and
matplotlib are imported by the functions that use them.
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Optional, Sequence

from recipes import cli
from recipes.cli import BadArgument


# Strategy and training ---------------------------------------------------------------------------------
def limit_threads() -> None:
    """When the launcher starts several ranks on this machine (HOROVOD_LOCAL_SIZE > 1),
    limits this rank's TensorFlow threads to its share of the cores. Call it before
    TensorFlow runs anything; calling it again does nothing."""
    global _THREADS_LIMITED
    if _THREADS_LIMITED:
        return
    import tensorflow as tf

    local_size = int(os.environ.get("HOROVOD_LOCAL_SIZE", "1") or 1)
    if local_size > 1:  # ranks share this machine's cores
        tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 1) // local_size))
        tf.config.threading.set_inter_op_parallelism_threads(2)
    _THREADS_LIMITED = True


_THREADS_LIMITED = False


def spatial_strategy(spatial: Sequence[int], batch_size: int):
    """Returns the `keras_spatial.SpatialStrategy` of `--spatial` for `--batch-size`.

    Call it (or `choose_layout`) before building anything with TensorFlow: it first
    limits the threads of ranks that share the machine (`limit_threads`).

    Args:
        spatial: the split (D, H, W) of each sample.
        batch_size: the global batch.

    Raises:
        BadArgument: if the world cannot be split so, or `batch_size` is not a
            multiple of the number of data groups.
    """
    limit_threads()
    import keras_spatial as ks

    try:
        strategy = ks.SpatialStrategy(spatial_shape=tuple(spatial))
    except ValueError as error:
        raise BadArgument(f"--spatial {','.join(map(str, spatial))}: {error}") from None
    if batch_size % strategy.data_size:
        raise BadArgument(
            f"--batch-size {batch_size} (global) must be a multiple of the number of data "
            f"groups, {strategy.data_size} (= world size {strategy.size} / spatial "
            f"{strategy.spatial_size})"
        )
    return strategy


def choose_layout(global_model, batch_size: int, hardware: Optional[str],
                  memory_limit: Optional[float] = None) -> tuple:
    """The layout of `--spatial auto`: what `keras_spatial.cost_model.auto_layout`
    predicts fastest for the launched world (`cli.world_size_from_environment`).

    Prints the choice and why on rank 0. Every rank computes the same choice from the
    same arguments (pure arithmetic), so no communication is needed.

    Args:
        global_model: a function of no arguments building the model with no spatial
            strategy, or a dict {label: such a function} of variants to choose among.
        batch_size: the global batch.
        hardware: `--hardware`, a profile name or JSON file (`cost_model.as_hardware`).
        memory_limit: `--memory-limit`, GiB per rank; None: the hardware's memory.

    Returns:
        (spatial shape, label of the chosen variant or None).

    Raises:
        BadArgument: without `hardware`, for a bad hardware description, or when no
            layout fits.
    """
    if hardware is None:
        raise BadArgument("--spatial auto needs --hardware (a profile such as 'lassen', or a JSON file)")
    limit_threads()
    from keras_spatial import cost_model

    world_size = cli.world_size_from_environment()
    try:
        machine = cost_model.as_hardware(hardware)
        choice = cost_model.auto_layout(
            global_model, world_size, machine,
            None if memory_limit is None else memory_limit * 2**30, global_batch=batch_size)
    except ValueError as error:
        raise BadArgument(f"--spatial auto: {error}") from None
    if cli.rank_from_environment() == 0:
        print(f"--spatial auto on {machine.name!r}, {world_size} rank(s): {choice.explanation}", flush=True)
    return choice.spatial_shape, choice.variant


def fit(model, strategy, train_ds, val_ds, epochs: int, model_path: str,
        callbacks=()) -> tuple[dict, list, float]:
    """Trains `model` on every rank, saving it to `model_path` after every epoch.

    Args:
        model: the compiled model, built in `strategy.scope()`.
        strategy: its `keras_spatial.SpatialStrategy`.
        train_ds: the training dataset (`strategy.distribute_dataset`).
        val_ds: the validation dataset, evaluated after every epoch.
        epochs: the number of epochs.
        model_path: the `.keras` file written (by rank 0) after every epoch.
        callbacks: more callbacks, run before the checkpoint (e.g.
            `keras_spatial.callbacks.RecomputeBatchNormStatistics`). Defaults to none.

    Returns:
        (history, epoch_seconds, fit_seconds): the Keras history as lists of floats,
        the seconds of every epoch (the first includes tracing), and of the whole fit.
    """
    import time

    import keras

    epoch_times: list = []

    class _Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_times.append(time.perf_counter() - self._start)

    start = time.perf_counter()
    history = model.fit(
        train_ds,
        validation_data=val_ds,
        epochs=epochs,
        shuffle=False,
        callbacks=strategy.callbacks(*callbacks, keras.callbacks.ModelCheckpoint(model_path)) + [_Timer()],
        verbose=2 if strategy.rank == 0 else 0,
    )
    fit_seconds = time.perf_counter() - start
    hist = {k: [float(v) for v in vals] for k, vals in history.history.items()}
    return hist, epoch_times, fit_seconds


# Data files -------------------------------------------------------------------------------
def find_data_files(data_dir: str, pattern: str, writer: str) -> list:
    """Returns the sorted files `data_dir`/`pattern` given as `--data`.

    Args:
        data_dir: the value of --data.
        pattern: a glob pattern, e.g. 'univ_*.h5'.
        writer: the tool that writes such files, named when there are none.

    Raises:
        BadArgument: if `data_dir` is not a directory or holds no such file.
    """
    if not os.path.isdir(data_dir):
        raise BadArgument(f"--data {data_dir!r} is not a directory")
    paths = sorted(glob.glob(os.path.join(data_dir, pattern)))
    if not paths:
        raise BadArgument(f"no files {pattern} in --data {data_dir!r} (write some with {writer})")
    return paths


def split_files(paths: Sequence[str], validation_fraction: float, remedy: str) -> tuple[list, list]:
    """Splits files, in sorted order, into training and validation files.

    The last round(validation_fraction * N) files, at least one, validate; the same
    split on every rank.

    Args:
        paths: the files, in any order.
        validation_fraction: the fraction of the files that validate, in (0, 1).
        remedy: what to do when the files cannot be split, ending the error message
            (e.g. 'write more universes').

    Returns:
        (training files, validation files), both sorted.

    Raises:
        BadArgument: if no file would remain for training (fewer than two files).
    """
    paths = sorted(paths)
    n_val = max(1, int(round(validation_fraction * len(paths))))
    if len(paths) - n_val < 1:
        raise BadArgument(
            f"{len(paths)} file(s) cannot be split into training and validation files "
            f"(--validation-fraction {validation_fraction} takes {n_val}); {remedy}"
        )
    return paths[:-n_val], paths[-n_val:]


def validation_batch_size(n_val: int, batch_size: int, data_size: int) -> tuple[int, bool]:
    """Chooses the global validation batch so that every sample is seen once if possible.

    Args:
        n_val: the number of validation samples.
        batch_size: the global training batch.
        data_size: the number of data groups (a batch is a multiple of it).

    Returns:
        (batch, True) with the largest multiple of `data_size` <= max(batch_size,
        data_size) that divides `n_val`, or (data_size, False) when none does (the last
        batch then repeats a few samples).
    """
    for b in range(max(batch_size, data_size), 0, -1):
        if b % data_size == 0 and n_val % b == 0:
            return b, True
    return data_size, False


# Outputs ------------------------------------------------------------------------------------
def run_config(args: argparse.Namespace, strategy, validation_batch: int,
               train_paths: Sequence[str], val_paths: Sequence[str], model) -> dict:
    """The settings every trainer records in history.json, besides its own.

    Args:
        args: the parsed options (`add_data_arguments`, `add_training_arguments`).
        strategy: the run's `keras_spatial.SpatialStrategy`.
        validation_batch: the global validation batch.
        train_paths: the training files.
        val_paths: the validation files.
        model: the trained model.

    Returns:
        The split, world and data group sizes, batches, epochs, learning rate, seed,
        file names and number of parameters, by name.
    """
    return {
        "spatial": list(strategy.spatial_shape), "world_size": strategy.size,
        "data_groups": strategy.data_size, "batch_size": args.batch_size,
        "validation_batch_size": validation_batch, "epochs": args.epochs,
        "learning_rate": args.learning_rate, "seed": args.seed,
        "train_files": [os.path.basename(p) for p in train_paths],
        "validation_files": [os.path.basename(p) for p in val_paths],
        "parameters": int(model.count_params()),
    }


def write_history(out: str, history: dict, summary: dict, config: dict,
                  metrics: Sequence[tuple[str, str]], **outputs) -> dict:
    """Writes OUT/history.json and the curves OUT/loss.png of a finished run (rank 0).

    Args:
        out: the output directory, holding the model OUT/model.keras.
        history: the Keras history, lists of floats by metric name.
        summary: the run's results.
        config: the run's settings.
        metrics: the panels of the plot, as for `plot_history`.
        **outputs: further output files to record, by name.

    Returns:
        The record written: {'history', 'summary', 'config', 'outputs'}, the last the
        paths of 'model', 'history', 'plot' and `outputs`.
    """
    import json

    record = {
        "history": history,
        "summary": summary,
        "config": config,
        "outputs": {"model": os.path.join(out, "model.keras"),
                    "history": os.path.join(out, "history.json"),
                    "plot": os.path.join(out, "loss.png"), **outputs},
    }
    with open(record["outputs"]["history"], "w") as f:
        json.dump(record, f, indent=2)
    plot_history(history, record["outputs"]["plot"], metrics)
    return record


def plot_history(history: dict, path: str, metrics: Sequence[tuple[str, str]]) -> None:
    """Writes the training and validation curves of `history` to the image `path`.

    Args:
        history: a Keras history (`History.history`): lists of per-epoch values by
            metric name, validation ones prefixed 'val_'; it must hold 'loss'.
        path: the image file to write (its format from the extension, e.g. '.png').
        metrics: one (metric name, title) pair a panel, left to right, e.g.
            (('loss', 'MSE'), ('mae', 'MAE')); the title also labels the y axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.5), squeeze=False)
    epochs = range(1, len(history["loss"]) + 1)
    for ax, (metric, title) in zip(axes[0], metrics):
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
