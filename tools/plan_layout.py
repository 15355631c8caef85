"""Print the layout plan of a recipe model on a mesh, without Horovod (pure arithmetic).

Per layer: type, global and local output shape, halo widths per axis for the rank's
shard, and activation memory; exits with status 1 and the layer's error message when the
mesh cannot keep the shards aligned.

Example:
    python tools/plan_layout.py --model cosmoflow --size 128 --spatial 2,1,1 --rank 1
    python tools/plan_layout.py --model cosmoflow --size 128 --spatial 4,1,1 --variant mlperf
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from recipes.cli import non_negative_int, positive_int, spatial_shape  # noqa: E402  (after the path and environment)

MODELS = ("cosmoflow",)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="cosmoflow")
    parser.add_argument("--size", type=positive_int("--size"), default=128, help="cubic input extent W (default 128)")
    parser.add_argument("--spatial", type=spatial_shape, default=(1, 1, 1),
                        help="shards along depth,height,width (default 1,1,1)")
    parser.add_argument("--variant", choices=("paper", "mlperf"), default="paper",
                        help="the CosmoFlow variant (default paper)")
    parser.add_argument("--channels", type=positive_int("--channels"), default=4)
    parser.add_argument("--batch-norm", action="store_true")
    parser.add_argument("--rank", type=non_negative_int("--rank"), default=0, help="rank whose shard is shown (default 0)")
    parser.add_argument("--world-size", type=positive_int("--world-size"), default=None,
                        help="ranks in the world (default: the spatial size)")
    parser.add_argument("--batch-size", type=positive_int("--batch-size"), default=1, help="samples per rank (default 1)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from keras_spatial.plan import plan_for_mesh
    from recipes.cosmoflow.model import build_model

    def builder():
        return build_model(args.size, args.variant, channels=args.channels, batch_norm=args.batch_norm)

    try:
        plan_for_mesh(builder, args.spatial, args.rank, world_size=args.world_size,
                      batch_size=args.batch_size, print_fn=print)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
