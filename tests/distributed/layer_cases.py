"""Layer configurations for the distributed exactness tests (pure Python, no TF)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

from keras_spatial.halo import ShardAlignmentError, Window, plan_axis


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer configuration: `kind` is 'conv', 'max' or 'avg'."""

    name: str
    kind: str
    kwargs: tuple  # sorted (key, value) pairs, hashable
    channels: int = 2
    batch: int = 1
    seed: int = 0
    starts: tuple = (10, 9, 8)  # smallest global extents tried (`choose_extents`)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def windows(self) -> list[Window]:
        o = self.options
        if self.kind == "conv":
            k, s, d = (_triple(o.get(n, 1)) for n in ("kernel_size", "strides", "dilation_rate"))
        else:
            k = _triple(o["pool_size"])
            s = _triple(o.get("strides") or o["pool_size"])
            d = (1, 1, 1)
        return [Window(k[a], s[a], d[a], o.get("padding", "valid")) for a in range(3)]


def _triple(value) -> tuple[int, int, int]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * 3


def make_case(name: str, kind: str, channels=2, batch=1, seed=0, **kwargs) -> Case:
    return Case(name, kind, tuple(sorted(kwargs.items())), channels, batch, seed)


def conv_grid() -> list[Case]:
    """Kernel 1-5, strides 1-2, dilation 1-2 (not with stride 2), same/valid."""
    cases = []
    for k, s, d, pad in itertools.product(range(1, 6), (1, 2), (1, 2), ("same", "valid")):
        if s > 1 and d > 1:
            continue  # Keras forbids strides > 1 with dilation > 1
        cases.append(
            make_case(f"conv-k{k}-s{s}-d{d}-{pad}", "conv", filters=3, kernel_size=k,
                      strides=s, dilation_rate=d, padding=pad, seed=len(cases))
        )
    cases += [
        make_case("conv-nobias-relu", "conv", filters=4, kernel_size=3, padding="same",
                  use_bias=False, activation="relu", seed=101),
        make_case("conv-tanh-batch2", "conv", batch=2, filters=2, kernel_size=3,
                  padding="valid", activation="tanh", seed=102),
        make_case("conv-anisotropic", "conv", filters=3, kernel_size=(2, 3, 4),
                  strides=(2, 1, 2), padding="same", seed=103),
        make_case("conv-groups2", "conv", channels=4, filters=4, kernel_size=3, groups=2,
                  padding="same", seed=104),
        make_case("conv-mlperf-k2-same", "conv", filters=3, kernel_size=2, padding="same", seed=105),
    ]
    return cases


def pool_grid() -> list[Case]:
    """Max and average pooling: pool 2-3, strides 1-2, same/valid."""
    cases = []
    for kind, p, s, pad in itertools.product(("max", "avg"), (2, 3), (1, 2), ("same", "valid")):
        cases.append(
            make_case(f"{kind}-p{p}-s{s}-{pad}", kind, pool_size=p, strides=s, padding=pad,
                      seed=200 + len(cases))
        )
    return cases


def prime_cases() -> list[Case]:
    """A few layers on prime extents (13, 17, 11) and on a 155 x 240 x 240 MRI-like
    volume scaled down by 5 (31 x 48 x 48): uneven shards on every mesh that splits
    them."""
    cases = []
    for starts, tag in (((13, 17, 11), "prime"), ((31, 48, 48), "mri")):
        cases += [
            dataclasses.replace(make_case(f"{tag}-conv-k3-same", "conv", filters=2, kernel_size=3,
                                          padding="same", seed=300), starts=starts),
            dataclasses.replace(make_case(f"{tag}-conv-k2-s2-valid", "conv", filters=2, kernel_size=2,
                                          strides=2, seed=301), starts=starts),
            dataclasses.replace(make_case(f"{tag}-max-p3-s2-same", "max", pool_size=3, strides=2,
                                          padding="same", seed=302), starts=starts),
            dataclasses.replace(make_case(f"{tag}-avg-p2-s1-valid", "avg", pool_size=2, strides=1,
                                          padding="valid", seed=303), starts=starts),
        ]
    return cases


def random_cases(seed: int, count: int) -> list[Case]:
    """Seeded random configurations drawn from the supported space."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        kind = rng.choice(["conv", "conv", "max", "avg"])
        pad = rng.choice(["same", "valid"])
        common = dict(channels=rng.randint(1, 3), batch=rng.randint(1, 2), seed=1000 + seed * 100 + i)
        if kind == "conv":
            strides = tuple(rng.randint(1, 2) for _ in range(3))
            dilation = (1, 1, 1) if max(strides) > 1 else tuple(rng.randint(1, 2) for _ in range(3))
            case = make_case(
                f"random{seed}-{i}-conv", "conv", filters=rng.randint(1, 4),
                kernel_size=tuple(rng.randint(1, 5) for _ in range(3)), strides=strides,
                dilation_rate=dilation, padding=pad, use_bias=rng.random() < 0.7, **common,
            )
        else:
            case = make_case(
                f"random{seed}-{i}-{kind}", kind,
                pool_size=tuple(rng.randint(2, 3) for _ in range(3)),
                strides=tuple(rng.randint(1, 2) for _ in range(3)), padding=pad, **common,
            )
        cases.append(case)
    return cases


def choose_extents(case: Case, spatial_shape, starts=None):
    """The smallest global extents >= `starts` (default `case.starts`) that
    `spatial_shape` can split for `case`.

    Returns (extents, servable). Any extent with at least one input and one output plane
    per shard serves (uneven shards split as `keras_spatial.halo.split_bounds`). Where
    none in 64 does, that axis gets the smallest extent divisible by its shards and
    servable is False: the layer must then refuse the layout at build time.
    """
    extents, servable = [], True
    for window, shards, start in zip(case.windows(), spatial_shape, starts or case.starts):
        for extent in range(start, start + 64):
            try:
                plan_axis(extent, shards, window)
            except ShardAlignmentError:
                continue
            extents.append(extent)
            break
        else:
            servable = False
            extents.append(-(-start // shards) * shards)
    return tuple(extents), servable
