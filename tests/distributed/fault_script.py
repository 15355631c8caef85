"""A 2-rank training job in which rank 1 fails on purpose, or (mode 'ok') trains with a
progress bar (run by tests/distributed/test_faults.py).

    horovodrun --gloo -np 2 -H localhost:2 python tests/distributed/fault_script.py --mode raise
"""

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["raise", "kill", "ok"], required=True)
    args = parser.parse_args()

    import keras
    import numpy as np

    import keras_spatial as ks
    from tests.distributed.training_workers import voxel_regression_model

    strategy = ks.SpatialStrategy((2, 1, 1))

    class Fault(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if strategy.rank == 1 and batch == 3 and args.mode != "ok":
                print(f"FAULT_AT {time.time():.3f}", flush=True)
                if args.mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected failure on rank 1")

    with strategy.scope():
        model = voxel_regression_model((8, 8, 8, 2))
    model.compile(optimizer=strategy.distribute_optimizer(keras.optimizers.SGD(1e-3)), loss="mse")
    samples = 4 if args.mode == "ok" else 400
    x = np.random.default_rng(0).standard_normal((samples, 8, 8, 8, 2)).astype("float32")
    model.fit(strategy.shard(x), strategy.shard(x[..., :1]), batch_size=1, epochs=2,
              verbose=1 if args.mode == "ok" else 0, callbacks=strategy.callbacks(Fault()))
    strategy.barrier()


if __name__ == "__main__":
    main()
