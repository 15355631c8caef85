"""Halo arithmetic for sliding-window layers split along one axis. Pure, no Horovod.

One rule covers 'same' and 'valid', strides, dilation and even kernels. Along one split
axis with global input extent E, s shards, window f = dilation*(k-1)+1 and stride t,
TensorFlow's global output extent O and leading padding p are::

    'same':  O = ceil(E/t), p = max((O-1)*t + f - E, 0) // 2
    'valid': O = floor((E-f)/t) + 1, p = 0

Every tensor, input or output, of global extent N along a split axis is split as
`numpy.array_split` splits N planes into s parts (`split_bounds`): the first N % s shards
hold N // s + 1 planes, the others N // s. Output shard j owns outputs [o0, o1) of that
split of O and needs the inputs [o0*t - p, (o1-1)*t - p + f). It owns the inputs
[i0, i1) of the split of E, so

    halo_before = i0 - (o0*t - p),   halo_after = ((o1-1)*t - p + f) - i1.

Positive: received from neighbours; negative: cropped; outside [0, E): padding. A local
'valid' window op on the input extended to the needed range then yields exactly the
shard's outputs. When E and O divide by s, every shard holds as many planes as the
others and its halos are the same as its neighbours'.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

Interval = tuple[int, int]
PADDINGS = ("same", "valid")


def _check_positive(name: str, value: int) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Window:
    """A 1D sliding window: kernel size, stride, dilation and padding mode."""

    kernel: int
    stride: int = 1
    dilation: int = 1
    padding: str = "valid"

    def __post_init__(self):
        _check_positive("kernel", self.kernel)
        _check_positive("stride", self.stride)
        _check_positive("dilation", self.dilation)
        padding = str(self.padding).lower()
        if padding not in PADDINGS:
            raise ValueError(
                f"`padding` must be one of {PADDINGS}. Received: padding={self.padding!r}"
            )
        object.__setattr__(self, "padding", padding)

    @property
    def extent(self) -> int:
        """The span f = dilation * (kernel - 1) + 1 of one window."""
        return self.dilation * (self.kernel - 1) + 1

    def output_extent(self, input_extent: int) -> int:
        """Global output extent O, as TensorFlow computes it (0 if no window fits)."""
        if self.padding == "same":
            return -(-input_extent // self.stride)
        return max((input_extent - self.extent) // self.stride + 1, 0)

    def pad_before(self, input_extent: int) -> int:
        """Leading padding p of the global operation."""
        if self.padding == "valid":
            return 0
        out = self.output_extent(input_extent)
        return max((out - 1) * self.stride + self.extent - input_extent, 0) // 2


class ShardAlignmentError(ValueError):
    """A split the window cannot serve: some shard would hold no plane of its input or
    of its output."""


def split_bounds(extent: int, shards: int) -> tuple[Interval, ...]:
    """The global intervals [start, stop) of the `shards` parts of `extent` planes, as
    `numpy.array_split` splits them: the first `extent % shards` parts hold one plane
    more than the others.

    Raises:
        ShardAlignmentError: if `extent < shards` (a part would be empty).
        ValueError: for a non-positive extent or shard count.
    """
    extent = _check_positive("extent", extent)
    shards = _check_positive("shards", shards)
    if extent < shards:
        raise ShardAlignmentError(
            f"An extent of {extent} planes cannot be split into {shards} shards: every "
            "shard must hold at least one plane."
        )
    base, extra = divmod(extent, shards)
    starts = [j * base + min(j, extra) for j in range(shards + 1)]
    return tuple((starts[j], starts[j + 1]) for j in range(shards))


def shard_extent(extent: int, shards: int, shard: int) -> int:
    """Planes held by `shard` of `extent` planes split `shards` ways (`split_bounds`)."""
    start, stop = split_bounds(extent, shards)[shard]
    return stop - start


@dataclasses.dataclass(frozen=True)
class AxisPlan:
    """Which inputs each shard owns and needs along one split axis.

    Attributes:
        global_extent: input extent E of the whole volume.
        shards: number of shards s.
        window: the sliding window.
        output_extent: global output extent O.
        owned: per shard, the global input interval [i0, i1) it holds
            (`split_bounds(E, s)`).
        needed: per shard, the global input interval its outputs read; it may reach
            outside [0, E), where the padding value applies.
        outputs: per shard, the global output interval [o0, o1) it computes
            (`split_bounds(O, s)`).
    """

    global_extent: int
    shards: int
    window: Window
    output_extent: int
    owned: tuple[Interval, ...]
    needed: tuple[Interval, ...]
    outputs: tuple[Interval, ...] = ()

    def halo(self, shard: int) -> tuple[int, int]:
        """(halo_before, halo_after) of `shard`: positive receives, negative crops."""
        (i0, i1), (n0, n1) = self.owned[shard], self.needed[shard]
        return i0 - n0, n1 - i1

    def local_output_extent(self, shard: int) -> int:
        """Outputs `shard` computes along the axis."""
        start, stop = self.outputs[shard]
        return stop - start

    def local_input_extent(self, shard: int) -> int:
        """Inputs `shard` holds along the axis."""
        start, stop = self.owned[shard]
        return stop - start

    def extended_extent(self, shard: int) -> int:
        """Length of `shard`'s needed interval (its extended input)."""
        n0, n1 = self.needed[shard]
        return n1 - n0

    @property
    def even(self) -> bool:
        """Whether every shard holds as many inputs, reads as many and computes as many
        outputs as every other one."""
        return (len({stop - start for start, stop in self.owned}) == 1
                and len({stop - start for start, stop in self.needed}) == 1
                and len({stop - start for start, stop in self.outputs}) == 1)

    def transfer(self, sender: int, receiver: int) -> Optional[Interval]:
        """The global interval `sender` sends to `receiver`, or None if nothing."""
        if sender == receiver:
            return None
        n0, n1 = self.needed[receiver]
        o0, o1 = self.owned[sender]
        start, stop = max(n0, o0, 0), min(n1, o1, self.global_extent)
        return (start, stop) if start < stop else None

    def kept(self, shard: int) -> Optional[Interval]:
        """The part of its own inputs that `shard` keeps (own interval cut to `needed`)."""
        n0, n1 = self.needed[shard]
        o0, o1 = self.owned[shard]
        start, stop = max(n0, o0), min(n1, o1)
        return (start, stop) if start < stop else None

    def padding_before(self, shard: int) -> int:
        """Planes of padding value before the data (needed inputs below 0)."""
        return max(-self.needed[shard][0], 0)

    def padding_after(self, shard: int) -> int:
        """Planes of padding value after the data (needed inputs at or past E)."""
        return max(self.needed[shard][1] - self.global_extent, 0)

    @property
    def exchanges(self) -> bool:
        """Whether any shard receives anything from another one."""
        return any(
            self.transfer(p, q) is not None
            for p in range(self.shards)
            for q in range(self.shards)
        )

    def valid_counts(self, shard: int) -> list[int]:
        """Per local output of `shard`: how many window taps fall inside [0, E).

        Used by average pooling, which leaves padding out of the mean.
        """
        w = self.window
        p = w.pad_before(self.global_extent)
        counts = []
        for o in range(*self.outputs[shard]):
            taps = (o * w.stride - p + i * w.dilation for i in range(w.kernel))
            counts.append(sum(0 <= tap < self.global_extent for tap in taps))
        return counts


@dataclasses.dataclass(frozen=True)
class BoundaryOutput:
    """A local output whose window reaches into a neighbour's shard.

    Attributes:
        index: the output's index in this shard's outputs along the axis.
        local_taps: taps inside this shard.
        before: (start, stop) of the planes it reads in the block received from the
            neighbours before this shard (`exchange_axis`'s `before`, concatenated), or
            None.
        after: the same in the block received from the neighbours after it.
    """

    index: int
    local_taps: int
    before: Optional[Interval]
    after: Optional[Interval]


def local_window_boundary(plan: AxisPlan, shard: int) -> Optional[tuple[BoundaryOutput, ...]]:
    """Whether a window op run on `shard`'s own planes alone, with the layer's padding
    mode, puts this shard's outputs at the right places; if so, the outputs whose windows
    also read a neighbour's planes.

    The local op pads its own edges as TensorFlow would pad the whole volume. When its
    leading padding equals the shard's halo before (so output j of the local op is global
    output o0 + j) and it yields as many outputs as the shard owns, every output whose
    window stays inside the shard, or leaves it only where the volume ends, is exact;
    the outputs returned here read real planes of a neighbour where the local op saw
    padding, and need those planes added in (average: a weighted mean of the local
    result and the neighbours' planes; max: a maximum).

    Returns None when the local op's outputs are not aligned with the shard's, or when
    some output window has no tap inside the shard; an empty tuple when no output reads
    a neighbour.
    """
    window = plan.window
    start_in, stop_in = plan.owned[shard]
    local_in = stop_in - start_in
    local_out = plan.local_output_extent(shard)
    if window.output_extent(local_in) != local_out:
        return None
    local_pad = window.pad_before(local_in)
    first_out = plan.outputs[shard][0]
    if start_in - local_pad != first_out * window.stride - window.pad_before(plan.global_extent):
        return None
    received_before_start = max(plan.needed[shard][0], 0)
    boundary = []
    for j in range(local_out):
        first_tap = start_in + j * window.stride - local_pad
        taps = [first_tap + i * window.dilation for i in range(window.kernel)]
        local = sum(start_in <= t < stop_in for t in taps)
        before = [t for t in taps if 0 <= t < start_in]
        after = [t for t in taps if stop_in <= t < plan.global_extent]
        if not local:
            return None
        if not before and not after:
            continue
        if (before and before[-1] - before[0] + 1 != len(before)) or (
            after and after[-1] - after[0] + 1 != len(after)
        ):
            return None  # dilated taps: not a contiguous block of planes
        boundary.append(BoundaryOutput(
            index=j,
            local_taps=local,
            before=(before[0] - received_before_start, before[-1] + 1 - received_before_start) if before else None,
            after=(after[0] - stop_in, after[-1] + 1 - stop_in) if after else None,
        ))
    return tuple(boundary)


@functools.lru_cache(maxsize=4096)
def plan_axis(global_extent: int, shards: int, window: Window) -> AxisPlan:
    """Plan one axis of a window op over `global_extent` split into `shards` shards
    (`split_bounds`; they need not be equal).

    Raises:
        ShardAlignmentError: if no window fits, or E or O is smaller than `shards`.
    """
    global_extent = _check_positive("global_extent", global_extent)
    shards = _check_positive("shards", shards)
    out = window.output_extent(global_extent)
    if out < 1:
        raise ShardAlignmentError(
            f"The window (extent {window.extent}) is larger than the input extent "
            f"{global_extent} with padding 'valid'; there is no output."
        )
    owned, outputs = _split_input_and_output(global_extent, out, shards)
    p = window.pad_before(global_extent)
    needed = tuple(
        (o0 * window.stride - p, (o1 - 1) * window.stride - p + window.extent)
        for o0, o1 in outputs
    )
    return AxisPlan(global_extent, shards, window, out, owned, needed, outputs)


def _split_input_and_output(global_extent: int, output_extent: int, shards: int):
    """`split_bounds` of the input and output extents, with one message if either has
    fewer planes than shards."""
    if global_extent < shards or output_extent < shards:
        raise ShardAlignmentError(
            f"Input extent {global_extent} and output extent {output_extent} must both be "
            f"at least the {shards} shards, so that every shard holds a plane of each."
        )
    return split_bounds(global_extent, shards), split_bounds(output_extent, shards)


def transposed_output_extent(input_extent: int, kernel: int, stride: int, padding: str,
                             output_padding: Optional[int] = None) -> int:
    """Global output extent of a transposed convolution along one axis, as Keras computes
    it (no dilation): 'valid' gives (E-1)*t + k + output_padding (output_padding defaults
    to max(k, t) - k), 'same' gives E*t (or (E-1)*t + k % 2 + output_padding)."""
    if padding == "valid":
        extra = max(kernel, stride) - kernel if output_padding is None else output_padding
        return (input_extent - 1) * stride + kernel + extra
    if output_padding is None:
        return input_extent * stride
    return (input_extent - 1) * stride + kernel % 2 + output_padding


@dataclasses.dataclass(frozen=True)
class TransposedAxisPlan(AxisPlan):
    """The plan of one split axis of a transposed convolution.

    Global output o sums input i times kernel tap m wherever i*t + m = o + pad_before.
    A shard receives the inputs `needed` (the inputs any of its outputs reads; outside
    [0, E) they are zeros), runs the 'valid' transposed convolution on them, and keeps
    the outputs from `output_start(shard)` on (`keras_spatial.ops.transposed_convolution_shard`).
    `window` holds the kernel, stride and padding mode.

    Attributes:
        pad_before: TensorFlow's leading padding of the transposed convolution: the raw
            outputs i*t + m it drops before global output 0.
    """

    pad_before: int = 0

    def output_start(self, shard: int) -> int:
        """Where `shard`'s first output lies in the 'valid' transposed convolution of
        its needed inputs; negative when it lies in a gap that no input reaches (k < t),
        filled with zeros."""
        first_output = self.outputs[shard][0]
        return first_output + self.pad_before - self.needed[shard][0] * self.window.stride


@functools.lru_cache(maxsize=4096)
def plan_transposed_axis(global_extent: int, shards: int, kernel: int, stride: int = 1,
                         padding: str = "valid",
                         output_padding: Optional[int] = None) -> TransposedAxisPlan:
    """Plan one axis of a transposed convolution over `global_extent` split into `shards`
    shards (`split_bounds`): any kernel, stride, padding and output padding Keras
    accepts (no dilation).

    Output shard j owns outputs [o0, o1) (`split_bounds` of the global output extent O)
    and reads the inputs [ceil((o0 + p - k + 1) / t), floor((o1 - 1 + p) / t) + 1), p
    being `pad_before`; with kernel <= stride and no padding these are exactly the
    inputs it owns (no halo). Its `needed` interval starts there and has the length of
    the longest such read, the same for every shard.

    Raises:
        ShardAlignmentError: if E or O is smaller than `shards`.
        ValueError: for a non-positive extent, kernel or stride, an unknown padding, or
            an output padding outside [0, stride).
    """
    global_extent = _check_positive("global_extent", global_extent)
    shards = _check_positive("shards", shards)
    window = Window(kernel, stride, 1, padding)  # checks kernel, stride and padding
    if output_padding is not None and not 0 <= output_padding < stride:
        raise ValueError(
            "`output_padding` must be at least 0 and less than the stride. "
            f"Received: output_padding={output_padding}, stride={stride}"
        )
    out = transposed_output_extent(global_extent, kernel, stride, window.padding, output_padding)
    owned, outputs = _split_input_and_output(global_extent, out, shards)
    pad = 0 if window.padding == "valid" else max((global_extent - 1) * stride + kernel - out, 0) // 2
    reads = [(-(-(o0 + pad - kernel + 1) // stride), (o1 - 1 + pad) // stride + 1) for o0, o1 in outputs]
    if len({o1 - o0 for o0, o1 in outputs}) == 1:
        # Equal shards: every extended input gets the same length, so that the exchange
        # along a later axis sends equally shaped planes (`keras_spatial.ops.
        # exchange_axis`); a shorter read is lengthened at its end, by inputs that reach
        # only outputs past the shard's.
        length = max(stop - start for start, stop in reads)
        reads = [(start, start + length) for start, _ in reads]
    return TransposedAxisPlan(global_extent, shards, window, out, owned, tuple(reads), outputs, pad)


@functools.lru_cache(maxsize=4096)
def plan_upsampling_axis(global_extent: int, shards: int, size: int) -> AxisPlan:
    """Plan one axis of nearest-neighbour up-sampling by `size` over `global_extent`
    split into `shards` shards.

    Output o repeats input o // size. Output shard j owns [o0, o1) of `split_bounds(
    E * size)` and needs the inputs [o0 // size, (o1 - 1) // size + 1); repeating them
    `size` times, it keeps the outputs from `o0 - needed_start * size` on. When E divides
    by the shards, the needed inputs are the owned ones (no halo). `window` is a 1-wide
    window, unused.

    Raises:
        ShardAlignmentError: if E is smaller than `shards`.
    """
    global_extent = _check_positive("global_extent", global_extent)
    shards = _check_positive("shards", shards)
    size = _check_positive("size", size)
    out = global_extent * size
    owned, outputs = _split_input_and_output(global_extent, out, shards)
    needed = tuple((o0 // size, (o1 - 1) // size + 1) for o0, o1 in outputs)
    return AxisPlan(global_extent, shards, Window(1), out, owned, needed, outputs)
