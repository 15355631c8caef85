"""Print the layout plan of a recipe model on a mesh, or choose the layout; no Horovod.

Per layer: type, global and local output shape, halo widths per axis for the rank's
shard, and activation memory; exits with status 1 and the layer's error message when the
mesh cannot split the model (an extent, at some layer, smaller than its shards). With
--hardware, the predicted time and memory of every layer follow (`keras_spatial.cost_model`). With --auto, the fastest layout of
--world-size ranks that fits --memory-limit per rank on --hardware is chosen
(`keras_spatial.cost_model.auto_layout`), printed with why, and its plan shown.

Example:
    python tools/plan_layout.py --model cosmoflow --size 128 --spatial 2,1,1 --rank 1
    python tools/plan_layout.py --model cosmoflow --size 128 --spatial 4,1,1 --variant mlperf
    python tools/plan_layout.py --model unet --size 128 --spatial 2,2,1 --hardware lassen
    python tools/plan_layout.py --model cosmoflow --size 512 --auto --world-size 64 \
        --batch-size 64 --hardware lassen --memory-limit 16
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from recipes.cli import non_negative_int, positive_float, positive_int, spatial_shape  # noqa: E402  (after the path)

MODELS = ("cosmoflow", "unet")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="cosmoflow")
    parser.add_argument("--size", type=positive_int("--size"), default=128, help="cubic input extent W (default 128)")
    parser.add_argument("--spatial", type=spatial_shape, default=(1, 1, 1),
                        help="shards along depth,height,width (default 1,1,1); not with --auto")
    parser.add_argument("--variant", choices=("paper", "mlperf"), default="paper",
                        help="the CosmoFlow variant (default paper)")
    parser.add_argument("--channels", type=positive_int("--channels"), default=None,
                        help="input channels (default 4 for CosmoFlow, 1 for the U-Net)")
    parser.add_argument("--batch-norm", action="store_true")
    parser.add_argument("--rank", type=non_negative_int("--rank"), default=0, help="rank whose shard is shown (default 0)")
    parser.add_argument("--world-size", type=positive_int("--world-size"), default=None,
                        help="ranks in the world (default: the spatial size; required with --auto)")
    parser.add_argument("--batch-size", type=positive_int("--batch-size"), default=None,
                        help="samples per rank (default 1); with --auto the GLOBAL batch (default: "
                             "the world size)")
    parser.add_argument("--hardware", default=None,
                        help="a profile of keras_spatial.hardware_profiles (lassen, h100) or a JSON "
                             "file of keras_spatial.cost_model.Hardware fields: predict time and "
                             "memory per layer (required with --auto)")
    parser.add_argument("--auto", action="store_true", help="choose the fastest layout that fits")
    parser.add_argument("--memory-limit", type=positive_float("--memory-limit"), default=None, metavar="GIB",
                        help="with --auto: GiB per rank (default: the hardware's memory)")
    parser.add_argument("--max-spatial", type=positive_int("--max-spatial"), default=None,
                        help="with --auto: the largest split of a sample tried (default: the world size)")
    args = parser.parse_args(argv)
    if args.auto:
        missing = [flag for flag, value in (("--world-size", args.world_size), ("--hardware", args.hardware))
                   if value is None]
        if missing:
            parser.error(f"--auto needs {' and '.join(missing)}")
        if args.spatial != (1, 1, 1):
            parser.error("--auto chooses the layout: leave out --spatial")
    elif args.memory_limit is not None or args.max_spatial is not None:
        parser.error("--memory-limit and --max-spatial are for --auto")
    return args


def builder(args: argparse.Namespace, gather_before_block=None):
    """A function of no arguments building the recipe model of `args` (global shapes)."""
    if args.model == "cosmoflow":
        from recipes.cosmoflow.model import build_model as build_cosmoflow

        return lambda: build_cosmoflow(args.size, args.variant, channels=args.channels or 4,
                                       batch_norm=args.batch_norm, gather_before_block=gather_before_block)
    from recipes.unet3d.model import build_model as build_unet

    return lambda: build_unet((args.size,) * 3 + (args.channels or 1,), batch_norm=args.batch_norm)


def main(argv=None) -> int:
    args = parse_args(argv)
    from keras_spatial import cost_model
    from keras_spatial.mesh import Mesh
    from keras_spatial.plan import plan_for_mesh

    build = builder(args)
    try:
        hardware = None if args.hardware is None else cost_model.as_hardware(args.hardware)
        spatial, world, batch = args.spatial, args.world_size, args.batch_size or 1
        if args.auto:
            global_batch = args.batch_size or args.world_size
            limit = None if args.memory_limit is None else args.memory_limit * 2**30
            variants = build
            if args.model == "cosmoflow" and args.variant == "paper":  # where the split stops, too
                variants = {f"gather_before_block={g}": builder(args, g) for g in (None, 7, 6, 5, 4, 3)}
            choice = cost_model.auto_layout(variants, world, hardware, limit, global_batch=global_batch,
                                            max_spatial_size=args.max_spatial)
            print(choice.explanation)
            spatial, batch = choice.spatial_shape, global_batch // choice.data_groups
            if choice.variant is not None:
                build = variants[choice.variant]
            print()
        model = build()
        rows = plan_for_mesh(model, spatial, args.rank, world_size=world, batch_size=batch, print_fn=print)
        if hardware is not None:
            mesh = Mesh(world_size=world or mesh_size(spatial), spatial_shape=spatial)
            costs = cost_model.model_costs(model, spatial, world_size=mesh.world_size, batch_size=batch, rows=rows)
            print(cost_model.format_predictions(costs, mesh, hardware, batch * mesh.data_size))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def mesh_size(spatial) -> int:
    d, h, w = spatial
    return d * h * w


if __name__ == "__main__":
    sys.exit(main())
