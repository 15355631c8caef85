"""The paper's claim in small: does CosmoFlow estimate cosmology better from larger volumes?

Usage (from the repository root; about 35 minutes on 2 cores with the defaults)::

    .venv/bin/python tools/cosmoflow_volume_claim.py            # outputs/claim, docs/cosmoflow_claim.*
    .venv/bin/python tools/cosmoflow_volume_claim.py --count 64 --epochs 2 --crops 32,64 \\
        --doc /tmp/claim.md                                      # a quick look

1. Writes --count synthetic universes of 128^3 x 4 (tools/write_universes.py; skipped
   when they are there).
2. Trains the paper's CosmoFlow, from the same initial weights (seed), on the corner
   crops 32^3, 64^3 and on the whole 128^3 volumes of the SAME universes: same training
   and validation files, same epochs, batch and learning rate, on --np local ranks with
   each sample split in depth (`python -m recipes.cosmoflow.train --crop C --spatial
   np,1,1`).
3. Loads every trained model.keras in this one process (a whole-volume model), predicts
   the validation crops and reports the validation MSE per cosmological parameter, next
   to two references that do not learn from pixels: the mean training label, and a
   least-squares fit of the labels on 8 summary statistics of each crop (per-channel mean
   and standard deviation of log(1 + counts)), which shows how much information each
   volume holds about the parameters.
4. Writes the table (with the command and wall times) to --doc and a plot next to it.
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
from demo_cosmoflow import job_environment, run_quietly  # noqa: E402  (tools/)
UNIVERSE_SIZE = 128
PARAMETERS = ("Omega_m", "sigma_8", "n_s", "h")


def _crops(text: str) -> list:
    try:
        crops = sorted({int(v) for v in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers. Received: {text!r}")
    if not crops or any(c < 32 or c > UNIVERSE_SIZE for c in crops):
        raise argparse.ArgumentTypeError(
            f"crops must lie in [32, {UNIVERSE_SIZE}] (the model needs at least 32). Received: {text!r}"
        )
    return crops


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosmoflow_volume_claim.py", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(REPO_ROOT, "outputs", "claim"),
                        help="work directory: universes/ and one run per crop (default outputs/claim)")
    parser.add_argument("--count", type=int, default=512, help="universes (default 512; 1/4 validate)")
    parser.add_argument("--crops", type=_crops, default=[32, 64, 128],
                        help="crop extents to compare (default 32,64,128)")
    parser.add_argument("--epochs", type=int, default=12, help="epochs for every crop (default 12)")
    parser.add_argument("--batch-size", type=int, default=4, help="global batch (default 4)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="Adam (default 1e-4)")
    parser.add_argument("--np", type=int, default=2, help="ranks; each sample split np,1,1 (default 2)")
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
        "--out", out, "--seed", "0",
    ]
    print("  " + " ".join(command), flush=True)
    start = time.perf_counter()
    status = run_quietly(command, env, REPO_ROOT)
    if status != 0:
        raise SystemExit(f"error: training on {crop}^3 crops failed with status {status}")
    return time.perf_counter() - start


def summary_statistics(paths, crops) -> tuple:
    """Labels (N, 4) and, per crop, features (N, 8): per-channel std and mean of log1p."""
    import h5py
    import numpy as np

    features = {c: [] for c in crops}
    labels = []
    for path in paths:
        with h5py.File(path, "r") as f:
            x = np.log1p(f["full"][:max(crops), :max(crops), :max(crops)].astype(np.float32))
            labels.append(np.asarray(f["unitPar"][...], np.float64))
        for c in crops:
            v = x[:c, :c, :c].reshape(-1, x.shape[-1]).astype(np.float64)
            features[c].append(np.concatenate([v.std(axis=0), v.mean(axis=0)]))
    return np.stack(labels), {c: np.stack(f) for c, f in features.items()}


def linear_fit_mse(train_x, train_y, val_x, val_y):
    import numpy as np

    a = np.c_[train_x, np.ones(len(train_x))]
    coef, *_ = np.linalg.lstsq(a, train_y, rcond=None)
    return ((np.c_[val_x, np.ones(len(val_x))] @ coef - val_y) ** 2).mean(axis=0)


def predict_validation(model_path: str, paths, crop: int):
    import h5py
    import keras
    import numpy as np

    import keras_spatial  # noqa: F401  (registers the spatial classes)

    model = keras.saving.load_model(model_path, compile=False)
    predictions = []
    for start in range(0, len(paths), 8):
        batch = []
        for path in paths[start:start + 8]:
            with h5py.File(path, "r") as f:
                batch.append(np.log1p(f["full"][:crop, :crop, :crop].astype(np.float32)))
        predictions.append(model.predict(np.stack(batch), verbose=0))
    return np.concatenate(predictions)


def _plot(rows, histories, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for crop, history in histories.items():
        epochs = range(1, len(history["val_loss"]) + 1)
        axes[0].plot(epochs, history["val_loss"], "o-", label=f"{crop}^3 validation")
        axes[0].plot(epochs, history["loss"], ":", color=axes[0].lines[-1].get_color(),
                     label=f"{crop}^3 training")
    axes[0].axhline(rows[0]["baseline"].mean(), color="gray", ls="--", label="mean label")
    axes[0].set_xlabel("epoch")
    axes[0].set_ylabel("MSE (4 scaled parameters)")
    axes[0].set_title("CosmoFlow (paper) on crops of the same universes")
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    width = 0.8 / (2 * len(rows))
    for i, row in enumerate(rows):
        x = np.arange(len(PARAMETERS)) + (2 * i - len(rows)) * width
        axes[1].bar(x, row["model"], width, label=f"CNN {row['crop']}^3")
        axes[1].bar(x + width, row["linear"], width, alpha=0.5, label=f"summary stats {row['crop']}^3")
    axes[1].set_xticks(range(len(PARAMETERS)), PARAMETERS)
    axes[1].set_ylabel("validation MSE")
    axes[1].set_title("per parameter (lower is better; label variance ~0.33)")
    axes[1].legend(fontsize=7)
    axes[1].grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.count < 8:
        raise SystemExit("error: --count must be at least 8")
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

    seconds, histories = {}, {}
    for i, crop in enumerate(args.crops, start=1):
        print(f"[2/3] training {i}/{len(args.crops)}: crops of {crop}^3", flush=True)
        out = os.path.join(args.dir, f"crop{crop}")
        seconds[crop] = train(args, data, crop, out, env)
        with open(os.path.join(out, "history.json")) as f:
            record = json.load(f)
        histories[crop] = record["history"]
        train_files = record["config"]["train_files"]
        val_files = record["config"]["validation_files"]

    print("[3/3] evaluating the saved models in one process", flush=True)
    import numpy as np

    train_paths = [os.path.join(data, name) for name in train_files]
    val_paths = [os.path.join(data, name) for name in val_files]
    train_y, train_features = summary_statistics(train_paths, args.crops)
    val_y, val_features = summary_statistics(val_paths, args.crops)
    baseline = ((val_y - train_y.mean(axis=0)) ** 2).mean(axis=0)
    rows = []
    for crop in args.crops:
        predicted = predict_validation(os.path.join(args.dir, f"crop{crop}", "model.keras"), val_paths, crop)
        model_mse = ((predicted - val_y) ** 2).mean(axis=0)
        logged = histories[crop]["val_loss"][-1]
        rows.append({
            "crop": crop, "model": model_mse, "baseline": baseline,
            "linear": linear_fit_mse(train_features[crop], train_y, val_features[crop], val_y),
            "logged": logged, "best": min(histories[crop]["val_loss"]), "seconds": seconds[crop],
        })
        print(f"  {crop}^3: validation MSE {model_mse.mean():.4f} (logged in training {logged:.4f}), "
              f"per parameter {np.round(model_mse, 4).tolist()}", flush=True)

    doc_png = os.path.splitext(args.doc)[0] + ".png"
    _plot(rows, histories, doc_png)
    command = "python tools/cosmoflow_volume_claim.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# CosmoFlow on larger volumes: the paper's claim in small",
        "",
        f"Command: `{command.strip()}` ({datetime.date.today().isoformat()}, 2 cores, "
        f"{args.np} Horovod ranks, each sample split {args.np},1,1). Total wall time "
        f"{(time.perf_counter() - started) / 60:.1f} min (writing universes {write_seconds:.0f} s).",
        "",
        f"Same {len(train_files)} training and {len(val_files)} validation universes "
        f"(synthetic lognormal, 128^3 x 4 redshifts, 512 Mpc/h), same initial weights, "
        f"{args.epochs} epochs, global batch {args.batch_size}, Adam {args.learning_rate:g}, "
        "paper CosmoFlow (9.4 M parameters) with the input standardization of "
        "`recipes.cosmoflow.train`; the crops are the corner C^3 of each universe. "
        "Validation MSE of the 4 parameters, each scaled to [-1, 1] (a uniform label has "
        "variance 1/3), from the saved model.keras loaded in one process:",
        "",
        "| input | CNN MSE | " + " | ".join(PARAMETERS) + " | best epoch MSE | summary-stats fit MSE | "
        + " | ".join(f"fit {p}" for p in PARAMETERS[:2]) + " | training wall time |",
        "|---|---|" + "---|" * len(PARAMETERS) + "---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['crop']}^3 crop | **{row['model'].mean():.4f}** | "
            + " | ".join(f"{v:.4f}" for v in row["model"])
            + f" | {row['best']:.4f} | {row['linear'].mean():.4f} | "
            + " | ".join(f"{v:.4f}" for v in row["linear"][:2])
            + f" | {row['seconds'] / 60:.1f} min |"
        )
    lines += [
        f"| mean training label | {baseline.mean():.4f} | "
        + " | ".join(f"{v:.4f}" for v in baseline) + " | | | | | |",
        "",
        f"![validation curves and per-parameter errors]({os.path.basename(doc_png)})",
        "",
        "\"CNN MSE\" is the final epoch's model; \"best epoch\" the lowest validation MSE logged "
        "during training. \"summary-stats fit\" is a least-squares fit of the labels on the "
        "per-channel mean and standard deviation of log(1 + counts) of the crop (fitted on the "
        "training universes): a reference for how much the crop tells about each parameter.",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(args.doc)), exist_ok=True)
    with open(args.doc, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.doc} and {doc_png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
