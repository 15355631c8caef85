"""CosmoFlow end to end in one command: synthetic universes -> 2-rank spatial training.

Usage (from the repository root)::

    python tools/demo_cosmoflow.py                 # outputs/demo/{universes,run}
    python tools/demo_cosmoflow.py --count 64 --epochs 2    # quicker

1. Writes --count synthetic universes of --size^3 x 4 into DIR/universes (skipped when
   they are already there: tools/write_universes.py resumes).
2. Trains the paper's CosmoFlow model on 2 local Horovod ranks, each sample split in
   depth (--spatial 2,1,1): `horovodrun --gloo -np 2 -H localhost:2 python -m
   recipes.cosmoflow.train ...`.
3. Prints the validation MSE next to the MSE of always predicting the mean training label,
   the validation MSE per parameter next to the reference estimators of
   recipes/cosmoflow/references.py (fitted on the same training universes), and where the
   model, history and plot are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TensorFlow's start-up lines, printed by every rank before its logging is configured.
STARTUP_NOISE = ("oneDNN custom operations are on", "All log messages before absl::InitializeLog")


def job_environment() -> dict:
    """This environment with the repository on PYTHONPATH, TensorFlow's logging quiet,
    oneDNN's CPU kernels (unless the caller chose) and one OpenMP thread per process (for
    the writer and the training job)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


def run_quietly(command, env, cwd) -> int:
    """Run `command`, streaming its output (stderr merged) without TensorFlow's
    start-up lines; return its exit status."""
    with subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1) as process:
        for line in process.stdout:
            if not any(noise in line for noise in STARTUP_NOISE):
                print(line, end="", flush=True)
        return process.wait()


def per_parameter_table(run_dir: str, config: dict) -> None:
    """Prints the validation MSE per parameter of the trained model (loaded in this one
    process) next to the reference estimators fitted on the training universes."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    sys.path.insert(0, REPO_ROOT)
    from cosmoflow_volume_claim import predict_validation
    from recipes.cosmoflow.references import file_features, reference_scores

    size = config["size"]
    train_paths, val_paths = ([os.path.join(config["data"], name) for name in config[key]]
                              for key in ("train_files", "validation_files"))
    train_y, train_features = file_features(train_paths, [size], progress=False)
    val_y, val_features = file_features(val_paths, [size], progress=False)
    scores = reference_scores(train_features[size], train_y, val_features[size], val_y)
    # The model as saved (with --batch-norm its statistics were recomputed in training).
    predicted = predict_validation(os.path.join(run_dir, "model.keras"), val_paths, size)["moving"]
    rows = {"model (CNN)": ((predicted - val_y) ** 2).mean(axis=0),
            "summary-stats fit": scores["summary_fit"],
            "power-spectrum fit": scores["power_spectrum_fit"],
            "mean training label": ((val_y - train_y.mean(axis=0)) ** 2).mean(axis=0)}
    print()
    print("validation MSE per parameter (scaled to [-1, 1]; fits trained on the training universes)")
    print(f"{'':22s}" + "".join(f"{p:>10s}" for p in ("Omega_m", "sigma_8", "n_s", "h")))
    for label, values in rows.items():
        print(f"{label:22s}" + "".join(f"{v:10.4f}" for v in values))
    print()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="demo_cosmoflow.py", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(REPO_ROOT, "outputs", "demo"),
                        help="demo directory (default outputs/demo)")
    parser.add_argument("--count", type=int, default=256, help="universes to write (default 256)")
    parser.add_argument("--size", type=int, default=64, help="universe extent W (default 64)")
    parser.add_argument("--epochs", type=int, default=8, help="training epochs (default 8)")
    parser.add_argument("--batch-size", type=int, default=4, help="global batch (default 4)")
    parser.add_argument("--variant", choices=("paper", "mlperf"), default="paper")
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2; spatial np,1,1)")
    parser.add_argument("--head", choices=("flatten", "gap", "gap-bn"), default="gap",
                        help="dense-head input (default gap, see docs/cosmoflow_claim.md)")
    parser.add_argument("--whiten", action=argparse.BooleanOptionalAction, default=True,
                        help="fixed whitening of the 4 channels at the model's input instead of the "
                             "per-channel standardization (default on, see docs/cosmoflow_claim.md)")
    parser.add_argument("--batch-norm", action=argparse.BooleanOptionalAction, default=True,
                        help="batch normalization after every convolution of the trunk (default on: "
                             "without it the network does not learn Omega_m, docs/cosmoflow_claim.md; the "
                             "moving statistics are recomputed before the last validation)")
    parser.add_argument("--schedule", choices=("constant", "warmup-cosine", "mlperf"),
                        default="warmup-cosine", help="learning-rate schedule (default warmup-cosine)")
    parser.add_argument("--learning-rate", type=float, default=1e-3,
                        help="peak learning rate (default 1e-3)")
    parser.add_argument("--augment", choices=("none", "flips", "cube"), default="cube",
                        help="symmetries of the cube on training universes (default cube)")
    args = parser.parse_args(argv)

    python = sys.executable
    horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
    if not os.path.exists(horovodrun):
        horovodrun = shutil.which("horovodrun")
    if not horovodrun:
        print("error: horovodrun not found (run `make venv` first)", file=sys.stderr)
        return 1
    env = job_environment()

    data = os.path.join(args.dir, "universes")
    run_dir = os.path.join(args.dir, "run")
    start = time.perf_counter()
    print(f"[1/2] {args.count} synthetic universes of {args.size}^3 x 4 -> {data}", flush=True)
    subprocess.run(
        [python, os.path.join(REPO_ROOT, "tools", "write_universes.py"), "--out", data,
         "--count", str(args.count), "--size", str(args.size), "--seed", "0"],
        check=True, env=env, cwd=REPO_ROOT,
    )
    write_seconds = time.perf_counter() - start

    print(f"[2/2] training on {args.np} ranks, each universe split {args.np},1,1 "
          f"({write_seconds:.0f} s so far)", flush=True)
    command = [
        horovodrun, "--gloo", "-np", str(args.np), "-H", f"localhost:{args.np}",
        python, "-m", "recipes.cosmoflow.train", "--data", data,
        "--spatial", f"{args.np},1,1", "--batch-size", str(args.batch_size),
        "--epochs", str(args.epochs), "--size", str(args.size), "--variant", args.variant,
        "--head", args.head, "--schedule", args.schedule, "--learning-rate", str(args.learning_rate),
        "--augment", args.augment, "--out", run_dir, "--seed", "0",
    ] + (["--batch-norm", "--recompute-bn-statistics"] if args.batch_norm else []) + (["--whiten"] if args.whiten else [])
    print("  " + " ".join(os.path.relpath(c, REPO_ROOT) if c.startswith(REPO_ROOT) else c
                          for c in command), flush=True)
    train_start = time.perf_counter()
    status = run_quietly(command, env, REPO_ROOT)
    train_seconds = time.perf_counter() - train_start
    if status != 0:
        print(f"error: training failed with status {status}", file=sys.stderr)
        return status

    with open(os.path.join(run_dir, "history.json")) as f:
        record = json.load(f)
    s, c, o = record["summary"], record["config"], record["outputs"]
    total = time.perf_counter() - start
    steps = s["train_steps_per_epoch"]
    later = s["epoch_seconds"][1:] or s["epoch_seconds"]
    print()
    print(f"CosmoFlow {c['variant']} model ({c['parameters']:,} parameters), {c['size']}^3 x 4, "
          f"{c['world_size']} ranks split {tuple(c['spatial'])}, {len(c['train_files'])} training / "
          f"{len(c['validation_files'])} validation universes, {c['epochs']} epochs, "
          f"global batch {c['batch_size']}")
    print(f"{'':34s}{'MSE':>10s}{'MAE':>10s}")
    print(f"{'model, validation (final epoch)':34s}{s['final_val_mse']:10.4f}{s['final_val_mae']:10.4f}")
    print(f"{'mean training label, validation':34s}{s['baseline_val_mse']:10.4f}{s['baseline_val_mae']:10.4f}")
    print(f"{'model, training (last epoch)':34s}{s['final_train_mse']:10.4f}")
    ratio = s["final_val_mse"] / s["baseline_val_mse"]
    if ratio < 0.95:
        verdict = "has learned more than the mean label"
    else:
        verdict = ("is NOT clearly better than predicting the mean label (train longer or on "
                   "more universes: docs/cosmoflow_claim.md shows what longer runs reach)")
    print(f"-> validation MSE is {ratio:.3f} x the mean-label predictor's: the model {verdict}")
    per_parameter_table(run_dir, c)
    print(f"time: writing {write_seconds:.0f} s, training job {train_seconds:.0f} s "
          f"(epoch {s['epoch_seconds'][0]:.0f} s first, {min(later):.0f} s later: "
          f"{min(later) / steps:.2f} s per step of {c['batch_size']} incl. validation), "
          f"total {total:.0f} s")
    print(f"model:   {os.path.relpath(o['model'])}  (loads in one process after "
          "`import keras_spatial`)")
    print(f"history: {os.path.relpath(o['history'])}")
    print(f"plot:    {os.path.relpath(o['plot'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
