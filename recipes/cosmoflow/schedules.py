"""Learning-rate schedules of the CosmoFlow trainer (`--schedule`).

- "constant": the given learning rate throughout, with Adam (the paper's optimizer).
- "warmup-cosine": Adam; a linear warm-up from 0 over the first `warmup_epochs`, then a
  cosine decay to 1% of the peak by the last step.
- "mlperf": MLPerf HPC's CosmoFlow reference (mlcommons/hpc `cosmoflow/configs/cosmo.yaml`
  and `utils/optimizers.py`): SGD with momentum 0.9; base learning rate 0.001 at batch 64,
  scaled linearly to the global batch (the peak); epoch `e` < 4 runs at
  `base + e (peak - base) / 4`; after epoch 32 the peak times 0.25, after epoch 64 times
  0.125 (of the reference's 128 epochs). A run of fewer epochs keeps the boundaries at
  the same fractions of its length. The learning rate changes at epoch boundaries, as the
  reference's per-epoch callback does.
"""

from __future__ import annotations

import keras

SCHEDULES = ("constant", "warmup-cosine", "mlperf")
MLPERF_BASE_LR = 0.001
MLPERF_BASE_BATCH = 64
MLPERF_MOMENTUM = 0.9
MLPERF_EPOCHS = 128
MLPERF_WARMUP_EPOCHS = 4
MLPERF_DECAY = ((32, 0.25), (64, 0.125))
MLPERF_TARGET_VAL_MAE = 0.124
WARMUP_COSINE_FINAL_FRACTION = 0.01


@keras.saving.register_keras_serializable(package="keras_spatial_recipes")
class EpochPiecewise(keras.optimizers.schedules.LearningRateSchedule):
    """MLPerf CosmoFlow's per-epoch schedule, as a function of the optimizer step.

    Args:
        base: learning rate of epoch 0.
        peak: learning rate at the end of the warm-up.
        steps_per_epoch: optimizer steps in one epoch.
        warmup_epochs: epochs of linear warm-up from `base` to `peak`.
        boundaries: epochs after which `factors` apply (increasing).
        factors: the peak is multiplied by `factors[i]` in epochs > `boundaries[i]`.
    """

    def __init__(self, base, peak, steps_per_epoch, warmup_epochs, boundaries=(), factors=()):
        if len(boundaries) != len(factors) or list(boundaries) != sorted(boundaries):
            raise ValueError(
                "`boundaries` must be increasing and as many as `factors`. Received: "
                f"boundaries={boundaries}, factors={factors}"
            )
        if steps_per_epoch < 1 or warmup_epochs < 0:
            raise ValueError(
                "`steps_per_epoch` must be positive and `warmup_epochs` non-negative. "
                f"Received: steps_per_epoch={steps_per_epoch}, warmup_epochs={warmup_epochs}"
            )
        self.base, self.peak = float(base), float(peak)
        self.steps_per_epoch, self.warmup_epochs = int(steps_per_epoch), int(warmup_epochs)
        self.boundaries, self.factors = [int(b) for b in boundaries], [float(f) for f in factors]

    def __call__(self, step):
        ops = keras.ops
        epoch = ops.floor_divide(ops.cast(step, "int64"), self.steps_per_epoch)
        epoch = ops.cast(epoch, "float32")
        rate = ops.convert_to_tensor(self.peak, "float32")
        for boundary, factor in zip(self.boundaries, self.factors):
            rate = ops.where(epoch > boundary, self.peak * factor, rate)
        if self.warmup_epochs:
            warm = self.base + epoch * (self.peak - self.base) / self.warmup_epochs
            rate = ops.where(epoch < self.warmup_epochs, warm, rate)
        return rate

    def get_config(self):
        return {"base": self.base, "peak": self.peak, "steps_per_epoch": self.steps_per_epoch,
                "warmup_epochs": self.warmup_epochs, "boundaries": self.boundaries,
                "factors": self.factors}


def mlperf_schedule(global_batch: int, epochs: int, steps_per_epoch: int) -> EpochPiecewise:
    """The reference's schedule for a run of `epochs` epochs at `global_batch`."""
    scale = epochs / MLPERF_EPOCHS
    peak = MLPERF_BASE_LR * global_batch / MLPERF_BASE_BATCH
    warmup = min(epochs, max(1, round(MLPERF_WARMUP_EPOCHS * scale))) if epochs > 1 else 0
    boundaries = [max(warmup, round(b * scale)) for b, _ in MLPERF_DECAY]
    return EpochPiecewise(MLPERF_BASE_LR, peak, steps_per_epoch, warmup, boundaries,
                          [f for _, f in MLPERF_DECAY])


def make_optimizer(schedule: str, learning_rate: float, *, global_batch: int, epochs: int,
                   steps_per_epoch: int, warmup_epochs: int = 1):
    """(optimizer, description) for the trainer's `--schedule` (the optimizer still to be
    wrapped by `strategy.distribute_optimizer`).

    Raises:
        ValueError: for an unknown schedule.
    """
    import keras_spatial as ks

    if schedule == "constant":
        return ks.FusedAdam(learning_rate), f"Adam {learning_rate:g}"
    if schedule == "warmup-cosine":
        total = epochs * steps_per_epoch
        warmup = min(total - 1, max(0, warmup_epochs) * steps_per_epoch)
        rate = keras.optimizers.schedules.CosineDecay(
            0.0, max(1, total - warmup), alpha=WARMUP_COSINE_FINAL_FRACTION,
            warmup_target=learning_rate, warmup_steps=warmup)
        return ks.FusedAdam(rate), (
            f"Adam, warm-up to {learning_rate:g} over {warmup // steps_per_epoch} epoch(s), "
            f"cosine decay to {learning_rate * WARMUP_COSINE_FINAL_FRACTION:g}")
    if schedule == "mlperf":
        rate = mlperf_schedule(global_batch, epochs, steps_per_epoch)
        return keras.optimizers.SGD(rate, momentum=MLPERF_MOMENTUM), (
            f"SGD momentum {MLPERF_MOMENTUM}, lr {rate.base:g} -> {rate.peak:g} (batch "
            f"{global_batch} / {MLPERF_BASE_BATCH}) over {rate.warmup_epochs} epoch(s), x0.25 "
            f"after epoch {rate.boundaries[0]}, x0.125 after {rate.boundaries[1]}")
    raise ValueError(f"`schedule` must be one of {SCHEDULES}. Received: schedule={schedule!r}")

