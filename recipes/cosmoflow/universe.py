"""Synthetic CosmoFlow universes: lognormal matter fields sampled as Poisson counts.

Units: wavenumbers k in h/Mpc, lengths in Mpc/h, power in (Mpc/h)^3. Flat LambdaCDM.

1. Linear power P(k, z) = A k^n_s T^2(k) D^2(z), with the Eisenstein & Hu (1998, eqs.
   26-31) no-wiggle transfer function T, A fixed by sigma_8 (top-hat of radius 8 Mpc/h)
   and the growth D(z) of Carroll, Press & Turner (1992), normalized to D(0) = 1.
2. Lognormal field on a periodic W^3 grid of side L: xi = IFFT[P]; xi_G = ln(1 + xi);
   P_G = FFT[xi_G]; G = IFFT[FFT(white noise) sqrt(P_G / V_cell)];
   delta = exp(G - sigma_G^2 / 2) - 1, so that delta has exactly the correlation xi of
   the grid (up to the few negative P_G modes, which are set to 0).
3. Counts n ~ Poisson(nbar (1 + delta)), stored int16 (values above 32767 are clipped
   and counted). The channels are the same white noise at z = 0, 0.5, 1.5, 3.
4. Labels: (Omega_m, sigma_8, n_s, h) drawn uniformly from `PARAMETER_RANGES`, each
   scaled linearly to [-1, 1]. (h = H_0 / 100 km/s/Mpc; the scaled value is the same
   whether one thinks of h or H_0.)

Defaults: 4 Mpc/h cells (box 512 Mpc/h at W = 128; the box grows with W, as crops of a
larger universe do) and nbar = 64 counts per cell, the density of 1 particle per
(Mpc/h)^3 of the 512^3-particle, 512 Mpc/h simulations behind the CosmoFlow data.

File format (one sample per file, `univ_{index:06d}.h5`): dataset `full`, shape
(W, W, W, channels) int16, channels last, contiguous (a depth slab is one contiguous
read); dataset `unitPar`, shape (4,) float32, the scaled labels; file attributes
`seed`, `index`, `box_size`, `params` (float64 (4,), unscaled), `redshifts`, plus
`parameter_names`, `parameter_ranges`, `mean_count`, `size`, `omega_b_h2`, `t_cmb`,
`clipped_voxels` and `format`.

Every sample depends only on (seed, index): writers may split the indices freely.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Iterator, Optional, Sequence

import numpy as np

from recipes.writing import atomic_h5_file, check_seed, sample_rng

PARAMETER_NAMES = ("omega_m", "sigma_8", "n_s", "h")
PARAMETER_RANGES = ((0.25, 0.35), (0.7, 0.9), (0.9, 1.0), (0.6, 0.8))
REDSHIFTS = (0.0, 0.5, 1.5, 3.0)
OMEGA_B_H2 = 0.02237  # Planck 2018 baryon density, held fixed.
T_CMB = 2.7255  # Kelvin.
DEFAULT_CELL_SIZE = 4.0  # Mpc/h.
DEFAULT_MEAN_COUNT = 64.0  # counts per cell.
MIN_SIZE = 8
INT16_MAX = np.iinfo(np.int16).max
FORMAT = "keras_spatial.cosmoflow.univ/1"
_FFT_SLAB = 16  # planes per step of `rfftn3`.
# Random streams of one sample (see `recipes.sample_rng`).
_STREAM_PARAMS, _STREAM_NOISE, _STREAM_COUNTS = 0, 1, 2


def _check_positive_float(name: str, value: float) -> float:
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a positive number. Received: {name}={value!r}.")
    return float(value)


def tophat_window(x: np.ndarray) -> np.ndarray:
    """Fourier transform of a unit top-hat sphere, W(x) = 3 (sin x - x cos x) / x^3.

    Uses the series 1 - x^2/10 below x = 1e-3, where the closed form cancels.
    """
    x = np.asarray(x, dtype=np.float64)
    small = np.abs(x) < 1e-3
    safe = np.where(small, 1.0, x)
    closed = 3.0 * (np.sin(safe) - safe * np.cos(safe)) / safe**3
    return np.where(small, 1.0 - x**2 / 10.0, closed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cosmology:
    """A flat LambdaCDM cosmology and its linear matter power spectrum.

    Args:
        omega_m: matter density today, in (0, 1].
        sigma_8: rms linear density contrast in spheres of 8 Mpc/h at z = 0.
        n_s: primordial spectral index.
        h: Hubble constant in units of 100 km/s/Mpc.
        omega_b_h2: physical baryon density. Defaults to 0.02237.
        t_cmb: CMB temperature in Kelvin. Defaults to 2.7255.

    Raises:
        ValueError: for non-physical values.

    Example:
    >>> cosmo = Cosmology(omega_m=0.3, sigma_8=0.8, n_s=0.96, h=0.7)
    >>> round(float(cosmo.sigma_r(8.0)), 6)
    0.8
    """

    omega_m: float
    sigma_8: float
    n_s: float
    h: float
    omega_b_h2: float = OMEGA_B_H2
    t_cmb: float = T_CMB

    def __post_init__(self):
        for name in ("sigma_8", "n_s", "h", "omega_b_h2", "t_cmb"):
            object.__setattr__(self, name, _check_positive_float(name, getattr(self, name)))
        if not 0.0 < self.omega_m <= 1.0:
            raise ValueError(
                f"`omega_m` must be in (0, 1]. Received: omega_m={self.omega_m!r}."
            )
        object.__setattr__(self, "omega_m", float(self.omega_m))
        if self.omega_b_h2 >= self.omega_m * self.h**2:
            raise ValueError(
                "The baryon density must be below the matter density. Received: "
                f"omega_b_h2={self.omega_b_h2}, omega_m*h^2={self.omega_m * self.h**2:.5f}."
            )

    @classmethod
    def from_parameters(cls, params: Sequence[float], **kwargs) -> "Cosmology":
        """Builds a cosmology from the label vector (omega_m, sigma_8, n_s, h)."""
        return cls(**dict(zip(PARAMETER_NAMES, map(float, params))), **kwargs)

    @property
    def parameters(self) -> np.ndarray:
        """The label vector (omega_m, sigma_8, n_s, h), float64."""
        return np.array([getattr(self, name) for name in PARAMETER_NAMES], dtype=np.float64)

    def transfer(self, k: np.ndarray) -> np.ndarray:
        """Eisenstein & Hu no-wiggle transfer function T(k), k in h/Mpc; T(0) = 1."""
        k = np.asarray(k, dtype=np.float64)
        theta2 = (self.t_cmb / 2.7) ** 2
        omh2 = self.omega_m * self.h**2
        f_b = self.omega_b_h2 / omh2
        sound_horizon = (  # Mpc (not Mpc/h), eq. 26.
            44.5 * np.log(9.83 / omh2) / np.sqrt(1.0 + 10.0 * self.omega_b_h2**0.75)
        )
        alpha = 1.0 - 0.328 * np.log(431.0 * omh2) * f_b + 0.38 * np.log(22.3 * omh2) * f_b**2
        k_mpc = k * self.h
        gamma_eff = self.omega_m * self.h * (
            alpha + (1.0 - alpha) / (1.0 + (0.43 * k_mpc * sound_horizon) ** 4)
        )
        q = k * theta2 / gamma_eff  # = k / (13.41 k_eq) with Gamma_eff for Omega_m h.
        l0 = np.log(2.0 * np.e + 1.8 * q)
        c0 = 14.2 + 731.0 / (1.0 + 62.5 * q)
        return l0 / (l0 + c0 * q**2)

    def growth(self, z: np.ndarray) -> np.ndarray:
        """Linear growth D(z) from Carroll, Press & Turner (1992), with D(0) = 1."""
        z = np.asarray(z, dtype=np.float64)
        return self._growth_g(z) / ((1.0 + z) * self._growth_g(np.float64(0.0)))

    def _growth_g(self, z: np.ndarray) -> np.ndarray:
        omega_l = 1.0 - self.omega_m
        matter = self.omega_m * (1.0 + z) ** 3
        omega_m_z = matter / (matter + omega_l)
        omega_l_z = omega_l / (matter + omega_l)
        denominator = omega_m_z ** (4.0 / 7.0) - omega_l_z + (
            (1.0 + omega_m_z / 2.0) * (1.0 + omega_l_z / 70.0)
        )
        return 2.5 * omega_m_z / denominator

    def _shape(self, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, dtype=np.float64)
        return k**self.n_s * self.transfer(k) ** 2

    def _sigma_r_unnormalized(self, radius: float) -> float:
        log_k = np.linspace(np.log(1e-5), np.log(1e3), 8193)
        k = np.exp(log_k)
        integrand = k**3 * self._shape(k) * tophat_window(k * radius) ** 2
        return float(np.sqrt(np.trapezoid(integrand, log_k) / (2.0 * np.pi**2)))

    @functools.cached_property
    def amplitude(self) -> float:
        """A in P(k) = A k^n_s T^2(k) D^2(z), fixed by sigma_8."""
        return (self.sigma_8 / self._sigma_r_unnormalized(8.0)) ** 2

    def sigma_r(self, radius: float, z: float = 0.0) -> float:
        """rms linear density contrast in top-hat spheres of `radius` Mpc/h at `z`."""
        return float(np.sqrt(self.amplitude) * self.growth(z)) * self._sigma_r_unnormalized(
            radius
        )

    def power(self, k: np.ndarray, z: float = 0.0) -> np.ndarray:
        """Linear matter power P(k, z) in (Mpc/h)^3, k in h/Mpc; P(0) = 0."""
        return self.amplitude * self._shape(k) * float(self.growth(z)) ** 2


def sample_parameters(
    rng: np.random.Generator, ranges: Sequence[Sequence[float]] = PARAMETER_RANGES
) -> np.ndarray:
    """Draws (omega_m, sigma_8, n_s, h) uniformly from `ranges`, float64 (4,)."""
    bounds = np.asarray(ranges, dtype=np.float64)
    return rng.uniform(bounds[:, 0], bounds[:, 1])


def scale_parameters(
    params: np.ndarray, ranges: Sequence[Sequence[float]] = PARAMETER_RANGES
) -> np.ndarray:
    """Maps parameters linearly from `ranges` to [-1, 1] (the `unitPar` labels)."""
    bounds = np.asarray(ranges, dtype=np.float64)
    return 2.0 * (np.asarray(params, np.float64) - bounds[:, 0]) / np.ptp(bounds, axis=1) - 1.0


def unscale_parameters(
    unit_params: np.ndarray, ranges: Sequence[Sequence[float]] = PARAMETER_RANGES
) -> np.ndarray:
    """Inverse of `scale_parameters`: maps [-1, 1] labels back to physical values."""
    bounds = np.asarray(ranges, dtype=np.float64)
    return bounds[:, 0] + (np.asarray(unit_params, np.float64) + 1.0) / 2.0 * np.ptp(bounds, axis=1)


def mode_numbers_squared(size: int) -> np.ndarray:
    """Integer |n|^2 = nx^2 + ny^2 + nz^2 of every mode of an rfftn of a size^3 grid.

    The wavenumber of a mode is k = (2 pi / box_size) sqrt(|n|^2). Shape
    (size, size, size // 2 + 1), int32.
    """
    full = np.fft.fftfreq(size, d=1.0 / size).astype(np.int32)
    half = np.fft.rfftfreq(size, d=1.0 / size).astype(np.int32)
    return full[:, None, None] ** 2 + full[None, :, None] ** 2 + half[None, None, :] ** 2


def rfft_mode_weights(size: int) -> np.ndarray:
    """How many full-grid modes each rfftn mode stands for (1 or 2), shape (size // 2 + 1,).

    The last axis of an rfftn keeps only kz >= 0: the kz = 0 plane and (for even size)
    the Nyquist plane hold their own conjugates, every other plane stands for two.
    """
    weights = np.full(size // 2 + 1, 2.0)
    weights[0] = 1.0
    if size % 2 == 0:
        weights[-1] = 1.0
    return weights


def power_on_grid(
    cosmology: Cosmology, *, size: int, box_size: float, z: float = 0.0
) -> np.ndarray:
    """P(|k|, z) at every rfftn mode of a size^3 grid of side `box_size`, float32.

    Evaluated exactly on the distinct values of |n|^2 and looked up; the k = 0 mode is 0.
    """
    n2 = mode_numbers_squared(size)
    distinct = np.arange(int(n2.max()) + 1, dtype=np.float64)
    k = 2.0 * np.pi / box_size * np.sqrt(distinct)
    table = cosmology.power(k, z).astype(np.float32)
    return table[n2]


def rfftn3(field: np.ndarray) -> np.ndarray:
    """`numpy.fft.rfftn` of a real cubic field, computed slab by slab (same values).

    Returns complex64 for float32 input, with about 8 bytes per voxel of temporaries
    instead of numpy's 24, which matters at W = 512.
    """
    size = field.shape[0]
    dtype = np.result_type(field.dtype, np.complex64)
    modes = np.empty((size, size, size // 2 + 1), dtype=dtype)
    for start in range(0, size, _FFT_SLAB):
        block = np.fft.rfft(field[start : start + _FFT_SLAB], axis=2)
        modes[start : start + _FFT_SLAB] = np.fft.fft(block, axis=1)
    for start in range(0, size // 2 + 1, _FFT_SLAB):
        columns = modes[:, :, start : start + _FFT_SLAB]
        modes[:, :, start : start + _FFT_SLAB] = np.fft.fft(columns, axis=0)
    return modes


def irfftn3(modes: np.ndarray, size: int, *, overwrite: bool = False) -> np.ndarray:
    """`numpy.fft.irfftn` back to a real size^3 field, computed slab by slab.

    Args:
        modes: half-spectrum of shape (size, size, size // 2 + 1); a real array is
            taken as complex.
        size: grid points per side.
        overwrite: use `modes` (complex64 or complex128) as scratch space instead of
            copying it. Defaults to False.

    Returns:
        The real field, float32 for complex64 (or real float32) input.
    """
    dtype = np.result_type(modes.dtype, np.complex64)
    work = modes if overwrite and modes.dtype == dtype else modes.astype(dtype, copy=True)
    for start in range(0, work.shape[2], _FFT_SLAB):
        columns = work[:, :, start : start + _FFT_SLAB]
        work[:, :, start : start + _FFT_SLAB] = np.fft.ifft(columns, axis=0)
    field = np.empty((size,) * 3, dtype=np.finfo(dtype).dtype)
    for start in range(0, size, _FFT_SLAB):
        block = np.fft.ifft(work[start : start + _FFT_SLAB], axis=1)
        field[start : start + _FFT_SLAB] = np.fft.irfft(block, n=size, axis=2)
    return field


def lognormal_gaussian_power(
    power: np.ndarray, *, size: int, box_size: float
) -> tuple[np.ndarray, float]:
    """The Gaussian power P_G whose exponential has the target power on the grid.

    xi = IFFT[P]; xi_G = ln(1 + xi); P_G = FFT[xi_G]. Negative P_G (the lognormal
    model cannot reach every P) and the k = 0 mode are set to 0.

    Args:
        power: target power on the rfftn grid, shape (size, size, size // 2 + 1).
        size: grid points per side.
        box_size: box side in Mpc/h.

    Returns:
        (P_G on the rfftn grid, float32; sigma_G^2, the variance of G per cell).
    """
    cell_volume = (box_size / size) ** 3
    xi = irfftn3(power, size, overwrite=False)
    xi /= np.float32(cell_volume)
    np.maximum(xi, np.float32(-1.0 + 1e-6), out=xi)
    xi_gauss = np.log1p(xi, out=xi)
    power_gauss = rfftn3(xi_gauss).real * np.float32(cell_volume)
    del xi, xi_gauss
    power_gauss[0, 0, 0] = 0.0
    np.maximum(power_gauss, 0.0, out=power_gauss)
    plane_sums = power_gauss.sum(axis=(0, 1), dtype=np.float64)
    variance = float(np.sum(plane_sums * rfft_mode_weights(size)))
    return power_gauss.astype(np.float32, copy=False), variance / box_size**3


def white_noise_modes(rng: np.random.Generator, size: int) -> np.ndarray:
    """rfftn of unit Gaussian white noise on a size^3 grid, complex64."""
    return rfftn3(rng.standard_normal((size,) * 3, dtype=np.float32))


def gaussian_field(
    noise_modes: np.ndarray, power: np.ndarray, *, size: int, box_size: float
) -> np.ndarray:
    """G = IFFT[FFT(white noise) sqrt(P / V_cell)]: a Gaussian field of power P, float32."""
    cell_volume = (box_size / size) ** 3
    amplitude = np.sqrt(power / np.float32(cell_volume))
    return irfftn3(noise_modes * amplitude, size, overwrite=True)


def lognormal_density(
    noise_modes: np.ndarray, power: np.ndarray, *, size: int, box_size: float
) -> np.ndarray:
    """delta = exp(G - sigma_G^2 / 2) - 1, the lognormal density contrast, float32.

    Args:
        noise_modes: `white_noise_modes(rng, size)`; reuse it for every redshift.
        power: target power on the rfftn grid (`power_on_grid`).
        size: grid points per side.
        box_size: box side in Mpc/h.

    Returns:
        delta, shape (size, size, size), with mean 0 and correlation function
        IFFT[power] over the ensemble.
    """
    power_gauss, variance = lognormal_gaussian_power(power, size=size, box_size=box_size)
    field = gaussian_field(noise_modes, power_gauss, size=size, box_size=box_size)
    field -= np.float32(variance / 2.0)
    np.exp(field, out=field)
    field -= np.float32(1.0)
    return field


def power_spectrum(
    field: np.ndarray, *, box_size: float, k_edges: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Binned power spectrum of a periodic cubic field.

    P(k) = V_cell^2 / V |DFT(field)_k|^2, averaged over the modes with
    k_edges[i] <= |k| < k_edges[i + 1] (k = 0 excluded).

    Args:
        field: real array of shape (W, W, W).
        box_size: box side in Mpc/h.
        k_edges: increasing bin edges in h/Mpc.

    Returns:
        (mean k per bin, mean P per bin, number of full-grid modes per bin).
    """
    size = field.shape[0]
    if field.ndim != 3 or len(set(field.shape)) != 1:
        raise ValueError(f"`field` must be a cubic 3D array. Received: field.shape={field.shape}.")
    modes = rfftn3(field)
    measured = (np.abs(modes) ** 2).astype(np.float64) * (box_size / size) ** 3 / size**3
    k = 2.0 * np.pi / box_size * np.sqrt(mode_numbers_squared(size))
    weights = np.broadcast_to(rfft_mode_weights(size), k.shape)
    which = np.digitize(k, k_edges) - 1
    keep = (k > 0) & (which >= 0) & (which < len(k_edges) - 1)
    bins = len(k_edges) - 1
    counts = np.bincount(which[keep], weights[keep], bins)
    mean_k = np.bincount(which[keep], (weights * k)[keep], bins) / np.maximum(counts, 1)
    mean_p = np.bincount(which[keep], (weights * measured)[keep], bins) / np.maximum(counts, 1)
    return mean_k, mean_p, counts


@dataclasses.dataclass(frozen=True, kw_only=True)
class UniverseConfig:
    """What every universe of a data set shares.

    Args:
        size: grid points per side W (at least 8). Defaults to 128.
        box_size: box side in Mpc/h. Defaults to 4 Mpc/h per cell (512 at W = 128).
        mean_count: mean count nbar per cell. Defaults to 64.
        redshifts: one channel per redshift. Defaults to (0, 0.5, 1.5, 3).
        parameter_ranges: (low, high) for omega_m, sigma_8, n_s, h. Defaults to
            ((0.25, 0.35), (0.7, 0.9), (0.9, 1.0), (0.6, 0.8)).
        omega_b_h2: fixed baryon density. Defaults to 0.02237.

    Raises:
        ValueError: for out-of-range values.
    """

    size: int = 128
    box_size: Optional[float] = None
    mean_count: float = DEFAULT_MEAN_COUNT
    redshifts: tuple[float, ...] = REDSHIFTS
    parameter_ranges: tuple[tuple[float, float], ...] = PARAMETER_RANGES
    omega_b_h2: float = OMEGA_B_H2

    def __post_init__(self):
        if isinstance(self.size, bool) or int(self.size) != self.size or self.size < MIN_SIZE:
            raise ValueError(
                f"The grid size must be an integer of at least {MIN_SIZE}. "
                f"Received: size={self.size!r}."
            )
        object.__setattr__(self, "size", int(self.size))
        if self.box_size is None:
            object.__setattr__(self, "box_size", DEFAULT_CELL_SIZE * self.size)
        object.__setattr__(self, "box_size", _check_positive_float("box_size", self.box_size))
        mean_count = _check_positive_float("mean_count", self.mean_count)
        if mean_count >= INT16_MAX / 10:
            raise ValueError(
                "`mean_count` must leave room for overdense cells in int16 (below "
                f"{INT16_MAX / 10:.0f}). Received: mean_count={self.mean_count!r}."
            )
        object.__setattr__(self, "mean_count", mean_count)
        redshifts = tuple(float(z) for z in self.redshifts)
        if not redshifts or any(not np.isfinite(z) or z < 0 for z in redshifts):
            raise ValueError(
                "`redshifts` must be one or more non-negative numbers. "
                f"Received: redshifts={self.redshifts!r}."
            )
        object.__setattr__(self, "redshifts", redshifts)
        ranges = tuple((float(lo), float(hi)) for lo, hi in self.parameter_ranges)
        if len(ranges) != len(PARAMETER_NAMES) or any(not lo < hi for lo, hi in ranges):
            raise ValueError(
                "`parameter_ranges` must be 4 (low, high) pairs with low < high, for "
                f"{PARAMETER_NAMES}. Received: parameter_ranges={self.parameter_ranges!r}."
            )
        object.__setattr__(self, "parameter_ranges", ranges)
        for corner in np.array(ranges).T:  # Raises for non-physical corners.
            Cosmology.from_parameters(corner, omega_b_h2=self.omega_b_h2)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape of the `full` dataset: (W, W, W, channels)."""
        return (self.size,) * 3 + (len(self.redshifts),)


@dataclasses.dataclass(frozen=True, eq=False)
class Universe:
    """One generated sample.

    Attributes:
        counts: (W, W, W, channels) int16 counts, channels last.
        params: (4,) float64 (omega_m, sigma_8, n_s, h).
        unit_params: (4,) float32 labels, `params` scaled to [-1, 1].
        clipped_voxels: how many counts exceeded 32767 and were clipped.
    """

    counts: np.ndarray
    params: np.ndarray
    unit_params: np.ndarray
    clipped_voxels: int

    def __repr__(self) -> str:
        return (
            f"Universe(shape={self.counts.shape}, params={np.round(self.params, 4).tolist()}, "
            f"clipped_voxels={self.clipped_voxels})"
        )


def density_contrasts(
    cosmology: Cosmology,
    noise_modes: np.ndarray,
    *,
    size: int,
    box_size: float,
    redshifts: Sequence[float] = REDSHIFTS,
) -> Iterator[np.ndarray]:
    """Yields the lognormal delta at each redshift from one white noise, one at a time."""
    power_today = power_on_grid(cosmology, size=size, box_size=box_size)
    for z in redshifts:
        power = power_today * np.float32(cosmology.growth(z) ** 2)
        yield lognormal_density(noise_modes, power, size=size, box_size=box_size)


def poisson_counts(
    delta: np.ndarray, mean_count: float, rng: np.random.Generator, *, out: np.ndarray
) -> int:
    """Draws n ~ Poisson(mean_count (1 + delta)) into the int16 array `out`.

    Works slab by slab along the first axis to bound memory. Counts above 32767 are
    clipped to 32767.

    Returns:
        The number of clipped voxels.
    """
    clipped = 0
    slab = max(1, (1 << 18) // max(1, delta[0].size))
    for start in range(0, delta.shape[0], slab):
        rate = mean_count * (1.0 + delta[start : start + slab].astype(np.float64))
        counts = rng.poisson(rate)
        clipped += int(np.count_nonzero(counts > INT16_MAX))
        out[start : start + slab] = np.minimum(counts, INT16_MAX)
    return clipped


def generate_universe(seed: int, index: int, config: UniverseConfig = UniverseConfig()) -> Universe:
    """Generates sample `index` of the data set `seed`; depends only on (seed, index).

    Args:
        seed: data set seed, in [0, 2**63 - 1].
        index: sample index, non-negative.
        config: grid, box, counts, redshifts and parameter ranges. Defaults to
            `UniverseConfig()` (128^3, 512 Mpc/h, 4 channels).

    Returns:
        A `Universe`.
    """
    params = sample_parameters(sample_rng(seed, index, _STREAM_PARAMS), config.parameter_ranges)
    cosmology = Cosmology.from_parameters(params, omega_b_h2=config.omega_b_h2)
    noise_modes = white_noise_modes(sample_rng(seed, index, _STREAM_NOISE), config.size)
    counts_rng = sample_rng(seed, index, _STREAM_COUNTS)
    counts = np.empty(config.shape, dtype=np.int16)
    clipped = 0
    deltas = density_contrasts(
        cosmology, noise_modes, size=config.size, box_size=config.box_size,
        redshifts=config.redshifts,
    )
    for channel, delta in enumerate(deltas):
        clipped += poisson_counts(delta, config.mean_count, counts_rng, out=counts[..., channel])
        del delta
    unit = scale_parameters(params, config.parameter_ranges).astype(np.float32)
    return Universe(counts=counts, params=params, unit_params=unit, clipped_voxels=clipped)


def universe_filename(index: int) -> str:
    """File name of sample `index`: `univ_{index:06d}.h5`."""
    return f"univ_{index:06d}.h5"


def _expected_attributes(seed: int, index: int, config: UniverseConfig) -> dict:
    return {
        "seed": np.int64(seed),
        "index": np.int64(index),
        "size": np.int64(config.size),
        "box_size": np.float64(config.box_size),
        "mean_count": np.float64(config.mean_count),
        "redshifts": np.asarray(config.redshifts, dtype=np.float64),
        "parameter_ranges": np.asarray(config.parameter_ranges, dtype=np.float64),
        "omega_b_h2": np.float64(config.omega_b_h2),
        "format": FORMAT,
    }


def write_universe_file(
    path: str, universe: Universe, *, seed: int, index: int, config: UniverseConfig
) -> None:
    """Writes one universe to `path` atomically (temporary name, then rename)."""
    with atomic_h5_file(path) as h5:
        h5.create_dataset("full", data=universe.counts)
        h5.create_dataset("unitPar", data=universe.unit_params.astype(np.float32))
        for name, value in _expected_attributes(seed, index, config).items():
            h5.attrs[name] = value
        h5.attrs["params"] = universe.params.astype(np.float64)
        h5.attrs["parameter_names"] = np.array(PARAMETER_NAMES, dtype="S")
        h5.attrs["t_cmb"] = np.float64(T_CMB)
        h5.attrs["clipped_voxels"] = np.int64(universe.clipped_voxels)


def _plain(value) -> object:
    return np.asarray(value).tolist() if value is not None else None


def universe_file_status(
    path: str, *, seed: int, index: int, config: UniverseConfig
) -> tuple[str, str]:
    """Whether `path` already holds sample (seed, index) of `config`.

    Reads only metadata, never the counts.

    Returns:
        (status, reason) with status one of "missing", "complete", "incomplete" (not a
        readable universe file: rewrite it) and "mismatch" (a complete file of another
        data set: do not overwrite silently).
    """
    import h5py

    if not os.path.exists(path):
        return "missing", ""
    try:
        with h5py.File(path, "r") as h5:
            full, unit = h5["full"], h5["unitPar"]
            if full.shape != config.shape or full.dtype != np.int16:
                reason = f"full has shape {full.shape} {full.dtype}, expected {config.shape} int16"
                return "mismatch", reason
            if unit.shape != (4,) or unit.dtype != np.float32 or "params" not in h5.attrs:
                return "incomplete", "labels missing or malformed"
            for name, expected in _expected_attributes(seed, index, config).items():
                found = h5.attrs.get(name)
                if isinstance(expected, str):
                    same = found == expected
                else:
                    same = found is not None and np.array_equal(np.asarray(found), expected)
                if not same:
                    found, expected = _plain(found), _plain(expected)
                    return "mismatch", f"attribute {name}={found}, expected {expected}"
    except (OSError, KeyError) as error:
        return "incomplete", f"unreadable ({error})"
    return "complete", ""


@dataclasses.dataclass(frozen=True)
class UniverseJob:
    """One file to write: sample `index` of data set `seed` into `directory`."""

    directory: str
    seed: int
    index: int
    config: UniverseConfig


def write_universe(job: UniverseJob) -> str:
    """Generates and writes one universe; the unit of work of the parallel writer.

    Returns:
        The path written.
    """
    check_seed(job.seed)
    path = os.path.join(job.directory, universe_filename(job.index))
    universe = generate_universe(job.seed, job.index, job.config)
    write_universe_file(path, universe, seed=job.seed, index=job.index, config=job.config)
    return path
