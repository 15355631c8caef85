"""The paper's claim in small: does CosmoFlow estimate cosmology better from larger volumes?

Usage (from the repository root)::

    .venv/bin/python tools/cosmoflow_volume_claim.py            # outputs/claim, docs/cosmoflow_claim.*
    .venv/bin/python tools/cosmoflow_volume_claim.py --count 64 --epochs 2 --crops 32,64 \\
        --doc /tmp/claim.md --json /tmp/claim.json              # a quick look

1. Writes --count synthetic universes of 128^3 x 4 (tools/write_universes.py; skipped
   when they are there) and uses the first --count of the directory.
2. Trains the paper's CosmoFlow trunk, from the same initial weights (seed), on the corner
   crops 32^3, 64^3 and on the whole 128^3 volumes of the SAME universes: same training
   and validation files, epochs, batch, schedule, head, batch normalization and
   augmentation, on --np local ranks with each sample split in depth (`python -m recipes.cosmoflow.train --crop C
   --spatial np,1,1 ...`).
3. Loads every trained model.keras in this one process (a whole-volume model), predicts
   the validation crops and reports the validation MSE per cosmological parameter, next
   to references that do not learn from pixels (recipes/cosmoflow/references.py): the
   mean training label, a fit on per-channel summary statistics and a power-spectrum
   regression, both fitted on the training universes only.
4. Writes the table (with the command and wall times) to --doc, a plot next to it and
   the per-parameter numbers to --json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # recipes.cosmoflow.references
from demo_cosmoflow import job_environment, run_quietly  # noqa: E402  (tools/)
from recipes import cli  # noqa: E402  (the project's argparse types)
UNIVERSE_SIZE = 128
PARAMETERS = ("Omega_m", "sigma_8", "n_s", "h")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosmoflow_volume_claim.py", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(REPO_ROOT, "outputs", "claim"),
                        help="work directory: universes/ and one run per crop (default outputs/claim)")
    parser.add_argument("--count", type=cli.int_at_least("--count", 8), default=384, help="universes (default 384; 1/4 validate)")
    parser.add_argument("--crops", type=cli.int_list("--crops", 32, UNIVERSE_SIZE), default=[32, 64, 128],
                        help=f"crop extents to compare, from 32 (the model's smallest input) to "
                             f"{UNIVERSE_SIZE} (default 32,64,128)")
    parser.add_argument("--epochs", type=cli.positive_int("--epochs"), default=16,
                        help="epochs for every crop (default 16)")
    parser.add_argument("--batch-size", type=cli.positive_int("--batch-size"), default=4,
                        help="global batch (default 4)")
    parser.add_argument("--learning-rate", type=float, default=1e-3,
                        help="peak Adam learning rate (default 1e-3)")
    parser.add_argument("--schedule", default="warmup-cosine",
                        choices=("constant", "warmup-cosine", "mlperf"),
                        help="learning-rate schedule of recipes.cosmoflow.train (default warmup-cosine)")
    parser.add_argument("--head", default="gap", choices=("flatten", "gap", "gap-bn"),
                        help="dense-head input of the paper model (default gap)")
    parser.add_argument("--whiten", action=argparse.BooleanOptionalAction, default=True,
                        help="start the model with a fixed whitening of the 4 channels "
                             "(recipes.cosmoflow.train --whiten) instead of the per-channel "
                             "standardization (default on; --no-whiten measured in docs/cosmoflow_claim.md)")
    parser.add_argument("--batch-norm", action=argparse.BooleanOptionalAction, default=True,
                        help="batch normalization between every convolution of the trunk and its "
                             "activation (recipes.cosmoflow.train --batch-norm; default on, "
                             "see docs/cosmoflow_claim.md)")
    parser.add_argument("--batch-renorm", action="store_true",
                        help="with --batch-norm: batch renormalization in the trunk "
                             "(recipes.cosmoflow.train --batch-renorm; default off)")
    parser.add_argument("--augment", default="cube", choices=("none", "flips", "cube"),
                        help="symmetries of the cube applied to training universes (default cube)")
    parser.add_argument("--dropout", type=cli.rate("--dropout"), default=0.2,
                        help="dropout rate of the dense head (recipes.cosmoflow.train --dropout; "
                             "default 0.2, the paper's)")
    parser.add_argument("--seed", type=cli.non_negative_int("--seed"), default=0,
                        help="seed of the trainings' initial weights, shuffling and augmentation "
                             "(recipes.cosmoflow.train --seed; default 0). The universes and their "
                             "training/validation split do not depend on it")
    parser.add_argument("--recompute-bn-statistics", action=argparse.BooleanOptionalAction, default=None,
                        help="before predicting, replace each trained model's batch-norm moving "
                             "statistics by the average batch statistics of its final weights "
                             "over the training crops, in batches of --batch-size "
                             "(keras_spatial.recompute_batch_norm_statistics); both results are "
                             "reported (default: on with --batch-norm, which it needs)")
    parser.add_argument("--reuse-trained", action="store_true",
                        help="keep a crop's finished run (DIR/cropC/history.json with these "
                             "epochs) instead of training it again, e.g. after an interruption")
    parser.add_argument("--json", default=os.path.join(REPO_ROOT, "docs", "cosmoflow_claim.json"),
                        help="machine-readable per-parameter MSE (default docs/cosmoflow_claim.json)")
    parser.add_argument("--np", type=int, default=1,
                        help="ranks; each sample split np,1,1 (default 1: on a 2-core machine one "
                             "process with 2 threads trains fastest, and a split trains the same model)")
    parser.add_argument("--doc", default=os.path.join(REPO_ROOT, "docs", "cosmoflow_claim.md"),
                        help="markdown report; the plot is written next to it (.png)")
    return parser


def _horovodrun() -> str:
    candidate = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    found = candidate if os.path.exists(candidate) else shutil.which("horovodrun")
    if not found:
        raise SystemExit("error: horovodrun not found (run `make venv` first)")
    return found


def train(args, data: str, crop: int, out: str, env: dict) -> float:
    command = [
        _horovodrun(), "--gloo", "-np", str(args.np), "-H", f"localhost:{args.np}",
        sys.executable, "-m", "recipes.cosmoflow.train", "--data", data, "--crop", str(crop),
        "--spatial", f"{args.np},1,1", "--batch-size", str(args.batch_size),
        "--epochs", str(args.epochs), "--learning-rate", str(args.learning_rate),
        "--schedule", args.schedule, "--head", args.head, "--augment", args.augment,
        "--out", out, "--seed", str(args.seed), "--dropout", str(args.dropout),
    ] + (["--batch-norm"] if args.batch_norm else []) + (["--whiten"] if args.whiten else []) + (
        ["--batch-renorm"] if args.batch_renorm else [])
    print("  " + " ".join(command), flush=True)
    start = time.perf_counter()
    status = run_quietly(command, env, REPO_ROOT)
    if status != 0:
        raise SystemExit(f"error: training on {crop}^3 crops failed with status {status}")
    return time.perf_counter() - start


def _read_crops(paths, crop: int):
    import h5py
    import numpy as np

    batch = []
    for path in paths:
        with h5py.File(path, "r") as f:
            batch.append(np.log1p(f["full"][:crop, :crop, :crop].astype(np.float32)))
    return np.stack(batch)


def predict_validation(model_path: str, paths, crop: int, recompute_from=None, batch_size: int = 4,
                       readout_layer: str = None, recompute_labels=None):
    """Predictions of the saved model for the crops of `paths`: {"moving": ...} with its
    moving batch-norm statistics and, with `recompute_from` (training files), also
    {"recomputed": ...} after `keras_spatial.recompute_batch_norm_statistics` over their
    crops in batches of `batch_size` (the last partial batch left out, as in training).
    With `readout_layer` (and `recompute_from` and its labels `recompute_labels`, (N, 4)),
    also {"readout": ...}: a ridge fit (`RidgeFit`) of those labels on that layer's
    outputs, applied to those of `paths`, i.e. what a linear readout of the trained trunk
    gives."""
    import keras
    import numpy as np

    import keras_spatial
    from recipes.cosmoflow.references import RidgeFit

    model = keras.saving.load_model(model_path, compile=False)

    def predict(network, files):
        parts = [network.predict(_read_crops(files[start:start + 8], crop), verbose=0)
                 for start in range(0, len(files), 8)]
        if isinstance(parts[0], (list, tuple)):
            return [np.concatenate(column) for column in zip(*parts)]
        return np.concatenate(parts)

    predictions = {"moving": predict(model, paths)}
    if recompute_from is not None:
        full = len(recompute_from) // batch_size * batch_size
        batches = (_read_crops(recompute_from[start:start + batch_size], crop)
                   for start in range(0, full, batch_size))
        started = time.perf_counter()
        used = keras_spatial.recompute_batch_norm_statistics(model, batches)
        print(f"  {crop}^3: batch-norm statistics recomputed from {used} batches of {batch_size} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        if readout_layer is None:
            predictions["recomputed"] = predict(model, paths)
        else:
            both = keras.Model(model.input, [model.get_layer(readout_layer).output, model.output])
            features, predictions["recomputed"] = predict(both, paths)
            train_features, _ = predict(both, recompute_from)
            readout = RidgeFit().fit(train_features, recompute_labels)
            predictions["readout"] = readout.predict(features)
    return predictions


ESTIMATOR_LABELS = {"cnn": "CNN", "cnn_moving_statistics": "CNN, moving BN statistics",
                    "cnn_readout": "CNN trunk + ridge readout",
                    "summary_fit": "summary-stats fit",
                    "power_spectrum_fit": "power-spectrum fit"}
JSON_NAMES = ("omega_m", "sigma_8", "n_s", "h")


def _plot(rows, histories, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for crop, history in histories.items():
        epochs = range(1, len(history["val_loss"]) + 1)
        axes[0].plot(epochs, history["val_loss"], "o-", label=f"{crop}^3 validation")
        axes[0].plot(epochs, history["loss"], ":", color=axes[0].lines[-1].get_color(),
                     label=f"{crop}^3 training")
    axes[0].axhline(rows[0]["baseline"].mean(), color="gray", ls="--", label="mean label")
    axes[0].set_xlabel("epoch")
    axes[0].set_ylabel("MSE (4 scaled parameters)")
    axes[0].set_yscale("log")
    axes[0].set_title("CosmoFlow on crops of the same universes")
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    crops = [row["crop"] for row in rows]
    for ax, parameter in zip(axes[1:], (0, 1)):
        for name, style in (("cnn", "o-"), ("cnn_moving_statistics", "o:"), ("summary_fit", "s--"),
                            ("power_spectrum_fit", "^--")):
            if name not in rows[0]["mse"]:
                continue
            ax.plot(crops, [row["mse"][name][parameter] for row in rows], style,
                    label=ESTIMATOR_LABELS[name])
        ax.axhline(rows[0]["baseline"][parameter], color="gray", ls=":", label="mean label")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(crops, [f"{c}^3" for c in crops])
        ax.set_xlabel("input volume")
        ax.set_ylabel("validation MSE")
        ax.set_title(f"{PARAMETERS[parameter]} (scaled to [-1, 1])")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.recompute_bn_statistics is None:
        args.recompute_bn_statistics = args.batch_norm
    elif args.recompute_bn_statistics and not args.batch_norm:
        parser.error("--recompute-bn-statistics needs --batch-norm")
    if args.batch_renorm and not args.batch_norm:
        parser.error("--batch-renorm needs --batch-norm")
    env = job_environment()
    os.environ.update({k: env[k] for k in ("TF_CPP_MIN_LOG_LEVEL",)})
    data = os.path.join(args.dir, "universes")
    started = time.perf_counter()
    print(f"[1/3] {args.count} universes of {UNIVERSE_SIZE}^3 x 4 -> {data}", flush=True)
    subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "tools", "write_universes.py"), "--out", data,
         "--count", str(args.count), "--size", str(UNIVERSE_SIZE), "--seed", "0"],
        check=True, env=env, cwd=REPO_ROOT,
    )
    write_seconds = time.perf_counter() - started
    # Only the first --count files take part (the directory may hold more).
    names = sorted(n for n in os.listdir(data) if n.startswith("univ_") and n.endswith(".h5"))[:args.count]
    subset = os.path.join(args.dir, f"universes_first{args.count}")
    os.makedirs(subset, exist_ok=True)
    for name in names:
        link = os.path.join(subset, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join(data, name), link)

    seconds, histories, reused = {}, {}, []
    for i, crop in enumerate(args.crops, start=1):
        print(f"[2/3] training {i}/{len(args.crops)}: crops of {crop}^3", flush=True)
        out = os.path.join(args.dir, f"crop{crop}")
        record = _finished_run(out, args) if args.reuse_trained else None
        if record is None:
            seconds[crop] = train(args, subset, crop, out, env)
            with open(os.path.join(out, "history.json")) as f:
                record = json.load(f)
        else:
            seconds[crop] = record["summary"]["fit_seconds"]
            reused.append(crop)
            print(f"  reusing the finished run in {out}", flush=True)
        histories[crop] = record["history"]
        train_files = record["config"]["train_files"]
        val_files = record["config"]["validation_files"]

    print("[3/3] evaluating the saved models in one process; reference estimators", flush=True)
    import numpy as np

    from recipes.cosmoflow.references import file_features, reference_scores, single_channel_scores

    train_paths = [os.path.join(subset, name) for name in train_files]
    val_paths = [os.path.join(subset, name) for name in val_files]
    reference_start = time.perf_counter()
    train_y, train_features = file_features(train_paths, args.crops)
    val_y, val_features = file_features(val_paths, args.crops)
    reference_seconds = time.perf_counter() - reference_start
    baseline = ((val_y - train_y.mean(axis=0)) ** 2).mean(axis=0)
    rows = []
    for crop in args.crops:
        predicted = predict_validation(
            os.path.join(args.dir, f"crop{crop}", "model.keras"), val_paths, crop,
            recompute_from=train_paths if args.recompute_bn_statistics else None,
            batch_size=args.batch_size,
            readout_layer="global_average" if args.recompute_bn_statistics and args.head != "flatten" else None,
            recompute_labels=train_y)
        mse = {"cnn": ((predicted.get("recomputed", predicted["moving"]) - val_y) ** 2).mean(axis=0)}
        if "recomputed" in predicted:
            mse["cnn_moving_statistics"] = ((predicted["moving"] - val_y) ** 2).mean(axis=0)
        if "readout" in predicted:
            mse["cnn_readout"] = ((predicted["readout"] - val_y) ** 2).mean(axis=0)
        mse.update(reference_scores(train_features[crop], train_y, val_features[crop], val_y))
        single = single_channel_scores(train_features[crop], train_y, val_features[crop], val_y)
        logged = histories[crop]["val_loss"][-1]
        rows.append({"crop": crop, "mse": mse, "single": single, "baseline": baseline, "logged": logged,
                     "best": min(histories[crop]["val_loss"]), "seconds": seconds[crop]})
        print(f"  {crop}^3: " + "; ".join(
            f"{ESTIMATOR_LABELS[k]} {np.round(v, 4).tolist()}" for k, v in mse.items()), flush=True)
    # A reused run's training time (from its history.json) counts as if trained now.
    wall_minutes = (time.perf_counter() - started + sum(seconds[c] for c in reused)) / 60

    doc_png = os.path.splitext(args.doc)[0] + ".png"
    _plot(rows, histories, doc_png)
    record = {
        "sizes": {str(row["crop"]): {name: dict(zip(JSON_NAMES, map(float, values)))
                                     for name, values in row["mse"].items()} for row in rows},
        "mean_label": dict(zip(JSON_NAMES, map(float, baseline))),
        "single_redshift_z0": {str(row["crop"]): {name: dict(zip(JSON_NAMES, map(float, values)))
                                                  for name, values in row["single"].items()}
                               for row in rows},
        "wall_minutes": round(wall_minutes, 1),
        "command": _command(argv),
        "train_universes": len(train_files), "validation_universes": len(val_files),
    }
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    lines = _report(args, argv, rows, baseline, train_files, val_files, wall_minutes,
                    write_seconds, reference_seconds, doc_png, reused)
    os.makedirs(os.path.dirname(os.path.abspath(args.doc)), exist_ok=True)
    with open(args.doc, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.doc}, {doc_png} and {args.json}", flush=True)
    return 0


def _finished_run(out: str, args):
    """The history record of a finished run in `out` with this run's settings, or None."""
    path = os.path.join(out, "history.json")
    if not (os.path.exists(path) and os.path.exists(os.path.join(out, "model.keras"))):
        return None
    with open(path) as f:
        record = json.load(f)
    config = record.get("config", {})
    same = (len(record.get("history", {}).get("loss", [])) == args.epochs
            and config.get("head") == args.head and config.get("schedule") == args.schedule
            and bool(config.get("batch_norm")) == args.batch_norm
            and bool(config.get("batch_renorm")) == args.batch_renorm
            and (config.get("input_whitening") is not None) == args.whiten
            and (config.get("augment") or "none") == args.augment
            and config.get("seed", 0) == args.seed
            and config.get("dropout") == args.dropout)
    return record if same else None


def _command(argv) -> str:
    given = argv if argv is not None else sys.argv[1:]
    return ("python tools/cosmoflow_volume_claim.py " + " ".join(given)).strip()


def _report(args, argv, rows, baseline, train_files, val_files, wall_minutes, write_seconds,
            reference_seconds, doc_png, reused=()) -> list:
    """The markdown table of the run (the analysis below it is written by hand)."""
    names = ("cnn", "summary_fit", "power_spectrum_fit")
    if args.recompute_bn_statistics:
        names = ("cnn", "cnn_moving_statistics") + names[1:]
    if "cnn_readout" in rows[0]["mse"]:
        names = names[:2] + ("cnn_readout",) + names[2:]
    lines = [
        "# CosmoFlow on larger volumes: the paper's claim in small",
        "",
        f"Command: `{_command(argv)}` ({datetime.date.today().isoformat()}, 2 cores, "
        f"{args.np} Horovod rank{'s' if args.np > 1 else ''}, each sample split {args.np},1,1). Total wall time "
        f"{wall_minutes:.1f} min (writing universes {write_seconds:.0f} s, reference "
        f"features {reference_seconds:.0f} s"
        + (f"; the {', '.join(f'{c}^3' for c in reused)} training counted from its "
           "recorded time (--reuse-trained)" if reused else "")
        + "). Machine-readable: "
        f"`{os.path.relpath(args.json, os.path.dirname(os.path.abspath(args.doc)))}`.",
        "",
        f"Same {len(train_files)} training and {len(val_files)} validation universes "
        f"(synthetic lognormal, 128^3 x 4 redshifts, 512 Mpc/h), same initial weights, "
        f"{args.epochs} epochs, global batch {args.batch_size}, schedule {args.schedule} "
        f"(peak {args.learning_rate:g}), head {args.head} (dropout {args.dropout:g}), augmentation {args.augment}; the "
        f"paper's CosmoFlow trunk{(' (batch renormalization' if args.batch_renorm else ' (batch normalization') + ' after every convolution)' if args.batch_norm else ''} with the input " + ("whitening" if args.whiten else "standardization") + " of `recipes.cosmoflow.train`; "
        "the crops are the corner C^3 of each universe. Validation MSE per parameter, each "
        "scaled to [-1, 1] (a uniform label has variance 1/3); the CNN from the saved "
        "model.keras loaded in one process"
        + (", its batch-norm moving statistics replaced by the average batch statistics of "
           "the final weights over the training crops (in batches of the training's size, "
           "`keras_spatial.recompute_batch_norm_statistics`) and, on the next row, as "
           "trained" if args.recompute_bn_statistics else "") + ":",
        "",
        "| input | estimator | mean | " + " | ".join(PARAMETERS) + " |",
        "|---|---|---|" + "---|" * len(PARAMETERS),
    ]
    for row in rows:
        for name in names:
            values = row["mse"][name]
            label = f"**{ESTIMATOR_LABELS[name]}**" if name == "cnn" else ESTIMATOR_LABELS[name]
            if name == "cnn" and args.recompute_bn_statistics:
                label = "**CNN, recomputed BN statistics**"
            lines.append(f"| {row['crop']}^3 | {label} | {values.mean():.4f} | "
                         + " | ".join(f"{v:.4f}" for v in values) + " |")
    lines += [
        "| any | mean training label | "
        f"{baseline.mean():.4f} | " + " | ".join(f"{v:.4f}" for v in baseline) + " |",
        "",
        "| input | CNN training wall time | best epoch validation MSE | final epoch (logged) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {row['crop']}^3 | {row['seconds'] / 60:.1f} min | {row['best']:.4f} | "
              f"{row['logged']:.4f} |" for row in rows]
    lines += [
        "",
        "What one redshift holds: the same reference fits on the features of the z = 0 "
        "channel alone (no change of the field between redshifts), next to all four "
        "channels:",
        "",
        "| input | estimator | Omega_m, z = 0 only | Omega_m, 4 redshifts | sigma_8, z = 0 only "
        "| sigma_8, 4 redshifts |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {row['crop']}^3 | {ESTIMATOR_LABELS[name]} | {row['single'][name][0]:.4f} | "
              f"{row['mse'][name][0]:.4f} | {row['single'][name][1]:.4f} | {row['mse'][name][1]:.4f} |"
              for row in rows for name in ("summary_fit", "power_spectrum_fit")]
    lines += [
        "",
        f"![validation curves and per-parameter errors]({os.path.basename(doc_png)})",
        "",
        "The references do not learn from pixels (`recipes/cosmoflow/references.py`): "
        "\"summary-stats fit\" regresses the labels on the per-channel mean and standard "
        "deviation of log(1 + counts); \"power-spectrum fit\" on the log binned power "
        "spectrum (8 logarithmic bins) of every channel's density contrast plus four moments "
        "of log(1 + counts) per channel. Both are ridge regressions fitted on the training "
        "universes (penalty chosen by 5-fold cross-validation inside them) and scored on the "
        "validation universes.",
        "",
    ]
    if "cnn_readout" in rows[0]["mse"]:
        lines += [
            "\"CNN trunk + ridge readout\" is a diagnosis, not a separate estimator: the same "
            "ridge regression on the trained network's global average features (the dense "
            "head's input, after the recomputed statistics), fitted on the training universes. "
            "Where it beats the CNN row, the trunk holds information its trained dense head "
            "does not deliver.",
            "",
        ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
