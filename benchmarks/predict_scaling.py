"""Predict strong scaling of the paper's two networks with keras_spatial.cost_model.

For each machine profile and GPU count, `auto_layout` picks the fastest layout (spatial
shape x data groups) that fits in device memory for a fixed global batch; the table gives
its predicted step time, the parts of it and the speedup over the smallest GPU count,
beside the speedups Oyama et al. (2020) report. Predictions, not measurements.

Writes the section between the markers of docs/performance_model.md and
docs/performance_scaling.png (unless --print-only).

Example:
    python benchmarks/predict_scaling.py
    python benchmarks/predict_scaling.py --print-only --collectives tree
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

BEGIN, END = "<!-- predict_scaling:begin -->", "<!-- predict_scaling:end -->"
# (label, builder arguments, GPU counts, global batch, the paper's speedup over the range)
SCENARIOS = {
    "cosmoflow": ("CosmoFlow 512^3 (paper network, gather before block 5)", (512, 1024, 2048), 64, 1.77),
    "unet": ("3D U-Net 256^3 (depth 3, 32 base filters, batch norm)", (256, 512), 16, 1.42),
}


def build(model: str):
    if model == "cosmoflow":
        from recipes.cosmoflow.model import build_model

        return build_model(512, gather_before_block=5)
    from recipes.unet3d.model import build_model

    return build_model((256, 256, 256, 1), batch_norm=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cosmoflow,unet")
    parser.add_argument("--profiles", default="lassen,h100")
    parser.add_argument("--collectives", choices=("ring", "tree", "both"), default="both")
    parser.add_argument("--max-spatial", type=int, default=64, help="largest split of a sample tried")
    parser.add_argument("--markdown", default=os.path.join(REPO_ROOT, "docs", "performance_model.md"))
    parser.add_argument("--plot", default=os.path.join(REPO_ROOT, "docs", "performance_scaling.png"))
    parser.add_argument("--print-only", action="store_true", help="print the tables, write nothing")
    parser.add_argument("--quick", action="store_true", help="smoke test: the same as --print-only")
    return parser.parse_args(argv)


def predict(args) -> list[dict]:
    from keras_spatial.cost_model import as_hardware, auto_layout

    algorithms = ("ring", "tree") if args.collectives == "both" else (args.collectives,)
    rows = []
    for model_name in args.models.split(","):
        label, counts, batch, paper = SCENARIOS[model_name]
        model = build(model_name)
        for profile in args.profiles.split(","):
            hardware = as_hardware(profile)
            for algorithm in algorithms:
                base = None
                for count in counts:
                    choice = auto_layout(model, count, hardware, global_batch=batch,
                                         max_spatial_size=args.max_spatial, collectives=algorithm)
                    p = choice.prediction
                    base = base or p.step
                    rows.append(dict(model=model_name, label=label, profile=profile, hardware=hardware.name,
                                     collectives=algorithm, gpus=count, batch=batch, prediction=p,
                                     speedup=base / p.step, paper=paper))
    return rows


def table(rows: list[dict]) -> str:
    lines = []
    for key in dict.fromkeys((r["model"], r["profile"], r["collectives"]) for r in rows):
        group = [r for r in rows if (r["model"], r["profile"], r["collectives"]) == key]
        first = group[0]
        lines += [
            f"**{first['label']}**, {first['hardware']}, global batch {first['batch']}, "
            f"{first['collectives']} collectives (paper: {first['paper']:.2f}x from {group[0]['gpus']} "
            f"to {group[-1]['gpus']} GPUs on Lassen)",
            "",
            "| GPUs | layout (spatial x groups) | step (ms) | compute | halo | layer collectives "
            "| gradient allreduce | memory/GPU (GiB) | predicted speedup |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in group:
            p = r["prediction"]
            shape = "x".join(map(str, p.spatial_shape))
            lines.append(
                f"| {r['gpus']} | {shape} x {p.data_groups} | {p.step * 1e3:.1f} | {p.compute * 1e3:.1f} | "
                f"{p.halo * 1e3:.1f} | {p.layer_collectives * 1e3:.1f} | {p.gradient_allreduce * 1e3:.1f} | "
                f"{p.memory / 2**30:.2f} | {r['speedup']:.2f}x |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    figure, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for axis, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for key in dict.fromkeys((r["profile"], r["collectives"]) for r in mine):
            group = [r for r in mine if (r["profile"], r["collectives"]) == key]
            axis.plot([r["gpus"] for r in group], [r["speedup"] for r in group], marker="o",
                      label=f"{key[0]}, {key[1]}")
        counts = [r["gpus"] for r in mine]
        axis.plot([min(counts), max(counts)], [1, mine[0]["paper"]], "k*--", label="paper (measured)")
        axis.plot([min(counts), max(counts)], [1, max(counts) / min(counts)], ":", color="grey", label="ideal")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("GPUs")
        axis.set_ylabel("speedup over the smallest count")
        axis.set_title(mine[0]["label"], fontsize=9)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_section(path: str, text: str) -> None:
    with open(path) as handle:
        document = handle.read()
    if BEGIN not in document or END not in document:
        raise SystemExit(f"error: {path} lacks the markers {BEGIN} ... {END}")
    head, rest = document.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as handle:
        handle.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = predict(args)
    text = table(rows)
    print(text)
    if not (args.print_only or args.quick):
        write_section(args.markdown, text)
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
