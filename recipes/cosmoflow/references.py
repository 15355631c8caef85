"""Reference estimators of the cosmological parameters, for judging what a CNN learned.

They do not learn from pixels: each turns a universe (or a cubic crop of it) into a few
numbers a cosmologist would compute, then a ridge regression fitted on the training
universes maps them to the labels, scored on the validation universes.

- `summary_features`: per channel (redshift) the standard deviation and mean of
  log(1 + counts): 2 x channels numbers.
- `power_spectrum_features`: per channel the binned power spectrum of the density
  contrast counts / mean - 1 (log10 of `POWER_BINS` logarithmic bins from the crop's
  fundamental mode to the Nyquist frequency), plus the mean, standard deviation,
  skewness and excess kurtosis of log(1 + counts): (POWER_BINS + 4) x channels numbers.
  The redshift dependence of the amplitude (growth, which depends on Omega_m) and the
  shape of P(k) (Omega_m h, n_s) are what these see.
- `RidgeFit`: features standardized on the training set, one ridge penalty per
  parameter chosen by K-fold cross-validation inside the training set, so the
  validation universes are used only for scoring.
- `single_channel_scores`: the same fits on the features of one redshift channel only,
  which separates what one snapshot of the field holds from what its growth between
  redshifts adds.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np

from recipes.cosmoflow.universe import mode_numbers_squared, rfft_mode_weights

POWER_BINS = 8
RIDGE_PENALTIES = tuple(10.0 ** e for e in range(-6, 4))
CROSS_VALIDATION_FOLDS = 5


def _check_volume(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts)
    if counts.ndim != 4 or len(set(counts.shape[:3])) != 1:
        raise ValueError(
            "`counts` must be one cubic sample (W, W, W, channels). "
            f"Received: shape={counts.shape}"
        )
    return counts


def summary_features(counts: np.ndarray) -> np.ndarray:
    """Per-channel std and mean of log(1 + counts) of one sample (W, W, W, C): (2 C,)."""
    values = np.log1p(_check_volume(counts).astype(np.float64)).reshape(-1, counts.shape[-1])
    return np.concatenate([values.std(axis=0), values.mean(axis=0)])


@functools.lru_cache(maxsize=8)
def _binning(size: int, bins: int) -> tuple:
    """(bin of every rfftn mode, -1 outside; full-grid modes per bin) of a size^3 grid."""
    k = 2.0 * np.pi / size * np.sqrt(mode_numbers_squared(size))
    edges = np.geomspace(2.0 * np.pi / size, np.pi * (1.0 + 1e-9), bins + 1)
    which = np.digitize(k, edges) - 1
    which[(k == 0) | (which >= bins)] = -1
    weights = np.broadcast_to(rfft_mode_weights(size), k.shape)
    keep = which >= 0
    modes = np.bincount(which[keep], weights[keep], bins)
    if np.any(modes == 0):
        raise ValueError(
            f"A {size}^3 sample has power-spectrum bins without modes; use fewer than "
            f"{bins} bins or larger crops. Received: bins={bins}"
        )
    return np.where(keep, which, bins).ravel(), np.ascontiguousarray(weights, np.float64).ravel(), modes


def binned_power(field: np.ndarray, bins: int = POWER_BINS) -> np.ndarray:
    """Mean |DFT|^2 / W^3 of a cubic real field in `bins` logarithmic |k| bins from the
    fundamental mode 2 pi / W to pi (per cell), the k = 0 mode excluded: (bins,)."""
    size = field.shape[0]
    which, weights, modes = _binning(size, bins)
    power = np.abs(np.fft.rfftn(np.asarray(field, np.float32))).ravel() ** 2
    sums = np.bincount(which, weights * power, bins + 1)[:bins]
    return sums / modes / size**3


def power_spectrum_features(counts: np.ndarray, bins: int = POWER_BINS) -> np.ndarray:
    """log10 binned P(k) of every channel's density contrast and four moments of its
    log(1 + counts), of one sample (W, W, W, C): ((bins + 4) C,).

    Wavenumbers are in units of 1 / cell; the bins are logarithmic from the fundamental
    mode 2 pi / W to pi (Nyquist). A bin without modes (tiny W) raises.
    """
    counts = _check_volume(counts)
    spectra, moments = [], []
    for channel in range(counts.shape[-1]):
        values = counts[..., channel].astype(np.float32)
        mean = float(values.mean(dtype=np.float64))
        if mean <= 0:
            raise ValueError(f"channel {channel} holds no counts; its density contrast is undefined")
        power = binned_power(values / np.float32(mean) - np.float32(1.0), bins)
        spectra.append(np.log10(np.maximum(power, 1e-30)))
        logs = np.log1p(values).ravel().astype(np.float64)
        centred = logs - logs.mean()
        std = centred.std()
        scaled = centred / std if std > 0 else centred
        squared = scaled * scaled
        moments.append([logs.mean(), std, np.mean(squared * scaled), np.mean(squared * squared) - 3.0])
    return np.concatenate([np.concatenate(spectra), np.ravel(moments)])


class RidgeFit:
    """Ridge regression of labels on features, its penalty chosen on the training set.

    Args:
        penalties: candidate ridge penalties (on standardized features). Defaults to
            10^-6 ... 10^3.
        folds: cross-validation folds inside the training set. Defaults to 5.

    Example:
    ```python
    fit = RidgeFit().fit(train_features, train_labels)
    mse = fit.score(val_features, val_labels)    # per parameter
    ```
    """

    def __init__(self, penalties: Sequence[float] = RIDGE_PENALTIES, folds: int = CROSS_VALIDATION_FOLDS):
        if not penalties or any(not np.isfinite(p) or p < 0 for p in penalties):
            raise ValueError(f"`penalties` must be non-negative numbers. Received: {penalties!r}")
        if int(folds) != folds or folds < 2:
            raise ValueError(f"`folds` must be an integer of at least 2. Received: folds={folds!r}")
        self.penalties = tuple(float(p) for p in penalties)
        self.folds = int(folds)
        self.penalty_: Optional[np.ndarray] = None

    @staticmethod
    def _solve(x: np.ndarray, y: np.ndarray, penalty: float):
        """(mean, scale, coefficients, intercept) of a ridge fit of y (N,) on x (N, F)."""
        mean, scale = x.mean(axis=0), x.std(axis=0)
        scale = np.where(scale > 0, scale, 1.0)
        z = (x - mean) / scale
        gram = z.T @ z + penalty * len(z) * np.eye(z.shape[1])
        coef = np.linalg.solve(gram, z.T @ (y - y.mean()))
        return mean, scale, coef, y.mean()

    def fit(self, features: np.ndarray, labels: np.ndarray) -> "RidgeFit":
        """Fits on the training `features` (N, F) and `labels` (N, P); returns self."""
        x = np.asarray(features, np.float64)
        y = np.asarray(labels, np.float64)
        if x.ndim != 2 or y.ndim != 2 or len(x) != len(y) or len(x) < self.folds:
            raise ValueError(
                "`features` (N, F) and `labels` (N, P) need the same N, at least `folds`. "
                f"Received: features {x.shape}, labels {y.shape}, folds={self.folds}"
            )
        fold_of = np.arange(len(x)) % self.folds
        errors = np.zeros((len(self.penalties), y.shape[1]))
        for i, penalty in enumerate(self.penalties):
            for fold in range(self.folds):
                train, held = fold_of != fold, fold_of == fold
                for p in range(y.shape[1]):
                    mean, scale, coef, intercept = self._solve(x[train], y[train, p], penalty)
                    predicted = ((x[held] - mean) / scale) @ coef + intercept
                    errors[i, p] += np.sum((predicted - y[held, p]) ** 2)
        self.penalty_ = np.array([self.penalties[i] for i in errors.argmin(axis=0)])
        self._models = [self._solve(x, y[:, p], self.penalty_[p]) for p in range(y.shape[1])]
        return self

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Predicted labels (N, P) of `features` (N, F)."""
        if self.penalty_ is None:
            raise ValueError("RidgeFit.predict needs fit() first")
        x = np.asarray(features, np.float64)
        return np.stack([((x - mean) / scale) @ coef + intercept
                         for mean, scale, coef, intercept in self._models], axis=1)

    def score(self, features: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Mean squared error per parameter (P,) on held-out `features`, `labels`."""
        return np.mean((self.predict(features) - np.asarray(labels, np.float64)) ** 2, axis=0)


ESTIMATORS = {"summary_fit": summary_features, "power_spectrum_fit": power_spectrum_features}


def crop_features(counts: np.ndarray, crops: Sequence[int]) -> dict:
    """{crop: {estimator name: features}} of the corner crop^3 of one sample."""
    return {crop: {name: extract(counts[:crop, :crop, :crop]) for name, extract in ESTIMATORS.items()}
            for crop in crops}


def file_features(paths: Sequence[str], crops: Sequence[int], progress: bool = True) -> tuple:
    """Labels (N, 4) and {crop: {estimator name: (N, F) features}} of the corner crops of
    the universe files `paths` (`full` counts, `unitPar` labels), each file read once."""
    import h5py
    from tqdm import tqdm

    largest = max(crops)
    labels, rows = [], []
    for path in tqdm(paths, desc="reference features", unit="universe", mininterval=10,
                     disable=not progress):
        with h5py.File(path, "r") as f:
            counts = f["full"][:largest, :largest, :largest]
            labels.append(np.asarray(f["unitPar"][...], np.float64))
        rows.append(crop_features(counts, crops))
    return np.stack(labels), {c: {name: np.stack([r[c][name] for r in rows]) for name in ESTIMATORS}
                              for c in crops}


def channel_columns(name: str, channel: int, channels: int, bins: int = POWER_BINS) -> np.ndarray:
    """Indices of the columns of estimator `name`'s features (of a sample with `channels`
    channels) that are computed from channel `channel` alone."""
    if name not in ESTIMATORS:
        raise ValueError(f"`name` must be one of {sorted(ESTIMATORS)}. Received: name={name!r}")
    if int(channels) != channels or channels < 1 or int(channel) != channel or not 0 <= channel < channels:
        raise ValueError(
            "`channel` must be an integer in [0, channels) and `channels` a positive integer. "
            f"Received: channel={channel!r}, channels={channels!r}"
        )
    if name == "summary_fit":  # [std of every channel, mean of every channel]
        return np.array([channel, channels + channel])
    # [bins of channel 0, bins of channel 1, ..., 4 moments of channel 0, ...]
    spectrum = np.arange(channel * bins, (channel + 1) * bins)
    moments = bins * channels + 4 * channel + np.arange(4)
    return np.concatenate([spectrum, moments])


def single_channel_scores(train: dict, train_labels, validation: dict, validation_labels,
                          channel: int = 0) -> dict:
    """{estimator name: per-parameter validation MSE} of the ridge fits of
    `reference_scores` on the features of ONE channel (redshift) only: what a single
    snapshot holds, without the change of the field between redshifts (growth)."""
    scores = {}
    for name in ESTIMATORS:
        width = train[name].shape[1]
        channels = width // 2 if name == "summary_fit" else width // (POWER_BINS + 4)
        columns = channel_columns(name, channel, channels)
        scores[name] = RidgeFit().fit(train[name][:, columns], train_labels).score(
            validation[name][:, columns], validation_labels)
    return scores


def reference_scores(train: dict, train_labels, validation: dict, validation_labels) -> dict:
    """{estimator name: per-parameter validation MSE} of ridge fits on the training set.

    `train` and `validation` map estimator names to feature matrices (N, F).
    """
    return {name: RidgeFit().fit(train[name], train_labels).score(validation[name], validation_labels)
            for name in ESTIMATORS}
