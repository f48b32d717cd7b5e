"""How scales are computed: finite ranges, prescaled grids, block views, FP scales.

Every scale is computed from the finite elements only (`finite_min_max`,
`finite_absmax`, `masked_absmax`), so one NaN or Inf cannot poison a tensor's grid;
on CPU the finite ranges are read cheaply (`_cpu_guard`).

====================  ======================================================
`affine_grid`         ``s = max((hi - lo) / levels, 1e-8)`` on ``f [lo, hi]``,
                      ``f = prescale(hi - lo, levels)`` (1 unless >= 2^64).
`symmetric_scale`     ``s = max(max|x| / max(L, 1), 1e-8)``, capped finite.
`fp_scale`            ``s = max(amax / largest, 2^-126)`` (1 if amax = 0).
`block_view`          blocks of ``size`` along axes, zero-padded, and back.
`scaled_statistic`    a range per tensor / channel / ``scale_axes`` / tile.
====================  ======================================================
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cpt_jax.formats._cpu_guard import guarded_reduction

Array = jax.Array

# Smallest scale of the integer grids (CPT's clamp), so a zero range never divides by 0.
MIN_SCALE = 1e-8


def reduce_axes(ndim: int, channel_axis: int | None) -> tuple | None:
    """The axes a range is reduced over: every axis but `channel_axis` (None: all of them).

    Example:
      >>> reduce_axes(3, -1), reduce_axes(3, None)
      ((0, 1), None)
    """
    if channel_axis is None or ndim == 0:
        return None
    axis = channel_axis % ndim if -ndim <= channel_axis < ndim else None
    if axis is None:
        raise ValueError(
            f"channel_axis={channel_axis} is out of range for a tensor of rank {ndim}")
    return tuple(i for i in range(ndim) if i != axis)


def finite_min_max(x: Array, axes) -> tuple[Array, Array]:
    """``(min, max)`` of the finite elements of `x` over `axes` (kept as size-1 dims).

    Non-finite elements take no part; a block with no finite element has range
    ``(0, 0)``. Cheap on CPU (`guarded_reduction`).

    Example:
      >>> [v.tolist() for v in finite_min_max(jnp.array([1.0, jnp.nan, -2.0, jnp.inf]), None)]
      [[-2.0], [1.0]]
    """
    def masked(x):
        finite = jnp.isfinite(x)
        lo = jnp.min(jnp.where(finite, x, jnp.inf), axis=axes, keepdims=True)
        hi = jnp.max(jnp.where(finite, x, -jnp.inf), axis=axes, keepdims=True)
        # An all-non-finite block has no range: use 0 so no NaN is created.
        lo = jnp.where(jnp.isfinite(lo), lo, 0.0)
        hi = jnp.where(jnp.isfinite(hi), hi, 0.0)
        return lo, hi

    return guarded_reduction(x, lambda x: plain_min_max(x, axes), masked)


def plain_min_max(x: Array, axes) -> tuple[Array, Array]:
    """``(min, max)`` of `x` over `axes` (kept as size-1 dims), non-finite elements
    included: NaN anywhere in a block makes its range NaN, +-Inf its end infinite.

    The values of `finite_min_max` on finite blocks, in one read of `x` over a long
    minor axis (`_min_max_one_pass`). The integer GEMMs range their operands so: a
    non-finite input then makes every output it touches non-finite (no code holds it).

    Example:
      >>> [v.tolist() for v in plain_min_max(jnp.array([1.0, -2.0, 3.0]), None)]
      [[-2.0], [3.0]]
    """
    if axes is None or len(tuple(axes)) == x.ndim:
        return _min_max_one_pass(x)
    return (jnp.min(x, axis=axes, keepdims=True), jnp.max(x, axis=axes, keepdims=True))


ONE_PASS_MIN_ROW = 256
"""The shortest minor axis for which `_min_max_one_pass` reads the tensor once."""


def _min_max_one_pass(x: Array) -> tuple[Array, Array]:
    """``(min(x), max(x))`` over every axis, reading `x` once when its minor axis has
    at least `ONE_PASS_MIN_ROW` elements: one variadic reduction along the rows (min
    and max of each row together), then the small per-row results.

    On XLA CPU a variadic reduction is fast along long rows and splits over the cores
    row by row (256 x 1024: 0.10 ms against 0.12 ms for two library reductions;
    2048 x 1024: 0.31 against 0.44, and against 0.37 reduced to a scalar at once), and
    slow over a short minor axis (a (128, 32, 32, 16) conv activation: 0.61 ms, 0.94
    to a scalar, against 0.44) and along one axis of several, so those keep two
    reductions. The values are those of ``jnp.min`` / ``jnp.max``.
    """
    keep = (1,) * x.ndim
    if x.ndim == 0 or x.shape[-1] < ONE_PASS_MIN_ROW:
        return jnp.min(x).reshape(keep), jnp.max(x).reshape(keep)
    lo, hi = jax.lax.reduce(
        (x, x), (jnp.array(jnp.inf, x.dtype), jnp.array(-jnp.inf, x.dtype)),
        lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])), (x.ndim - 1,))
    return jnp.min(lo).reshape(keep), jnp.max(hi).reshape(keep)


def finite_absmax(x: Array, axes) -> Array:
    """``max |x|`` over the finite elements of `x` over `axes` (0 if none), as size-1 dims.

    The same value as `masked_absmax`, cheap on CPU (`guarded_reduction`).
    """
    def masked(x):
        return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=axes, keepdims=True)

    return guarded_reduction(x, lambda x: plain_absmax(x, axes), masked)


def plain_absmax(x: Array, axes) -> Array:
    """``max |x|`` over `axes` (size-1 dims), non-finite elements included (NaN or Inf
    where a block holds one): `finite_absmax`'s value on finite blocks."""
    return jnp.max(jnp.abs(x), axis=axes, keepdims=True)


# Scales at or above 2^64 are computed on a range scaled by 2^-64 (`prescale`).
_HUGE_SCALE = 2.0 ** 64


def prescale(width: Array, levels: Array) -> Array:
    """``f = 2^-64`` where a grid's step ``width / levels`` is >= 2^64 or Inf, else 1.

    A range wider than float32 (``hi - lo = Inf`` for ``[-3e38, 3e38]``) or a step so
    large that its reciprocal is subnormal (XLA divides by a broadcast scale as a
    multiply by its reciprocal, and CPU flushes subnormals to 0: every code would
    be 0) is computed on ``f x``; ``f`` is a power of two, so scaling is exact and
    ``f = 1`` leaves the usual formulas bit for bit.

    Example:
      >>> float(prescale(jnp.float32(jnp.inf), 15.0)), float(prescale(jnp.float32(3.0), 3.0))
      (5.421010862427522e-20, 1.0)
    """
    return jnp.where(width / levels < _HUGE_SCALE, 1.0, 1.0 / _HUGE_SCALE).astype(jnp.float32)


def affine_grid(lo: Array, hi: Array, levels: Array) -> tuple[Array, Array, Array]:
    """`AffineInt`'s grid on ``[lo, hi]``, computed where nothing can overflow.

    With ``f = prescale(hi - lo, levels)``: ``lo_f = f lo``,
    ``s_f = max((f hi - f lo) / levels, 1e-8)``; the real grid's step is ``s_f / f``
    and its points are ``(c s_f + lo_f) / f``, ``c = 0 .. levels``. For every range
    narrower than ``2^64 levels`` (all but the extreme ones) ``f = 1``: the CPT
    formula ``s = max((max - min) / (2^b - 1), 1e-8)`` bit for bit.

    Args:
      lo, hi: the finite range (broadcastable, e.g. per channel).
      levels: ``2^b - 1``.

    Returns:
      ``(f, lo_f, s_f)``.

    Example:
      >>> f, lo_f, s_f = affine_grid(jnp.float32(-3e38), jnp.float32(3e38), 15.0)
      >>> float(s_f / f)  # (3e38 - -3e38) / 15, beyond float32 as hi - lo
      3.999999973526325e+37
    """
    f = prescale(hi - lo, levels)
    lo_f = lo * f
    return f, lo_f, jnp.maximum((hi * f - lo_f) / levels, MIN_SCALE)


def symmetric_scale(amax: Array, top: Array) -> tuple[Array, Array, Array]:
    """``(f, s_f, s)`` of `SymmetricInt`: ``s = max(max|x| / max(L, 1), 1e-8)`` computed on
    ``f max|x|`` (`prescale`), capped so that ``L s`` stays finite at ``max|x| ~ 3.4e38``."""
    levels = jnp.maximum(top, 1.0)
    f = prescale(amax, levels)  # 1 unless the step is >= 2^64
    scale_f = jnp.maximum(amax * f / levels, MIN_SCALE)
    cap = jnp.finfo(jnp.float32).max * (1.0 - 2.0 ** -20) / levels
    return f, scale_f, jnp.minimum(scale_f / f, cap)


def check_axis(value, name: str) -> None:
    """ValueError naming `name` unless `value` is an int axis."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int axis, got {value!r}")


def check_scaling(fmt) -> None:
    """ValueError unless `fmt`'s ``channel_axis`` / ``scale_axes`` / ``tile`` make one scaling.

    ``scale_axes``: a non-empty tuple of distinct int axes (the axes one scale
    spans: ``(-1,)`` is one scale per row, per token of an activation); exclusive
    with ``channel_axis``. ``tile``: an int >= 1 or a tuple of them, at most one per
    scale axis (the last ``len(tile)`` scale axes are split into blocks of that
    size, each block its own scale); it needs ``scale_axes``. A list (from a config
    file) is taken as a tuple.
    """
    name = type(fmt).__name__
    if fmt.channel_axis is not None:
        check_axis(fmt.channel_axis, f"{name}.channel_axis")
    axes = fmt.scale_axes
    if axes is not None:
        if isinstance(axes, list):
            object.__setattr__(fmt, "scale_axes", axes := tuple(axes))
        if not isinstance(axes, tuple) or not axes or len(set(axes)) != len(axes):
            raise ValueError(f"{name}.scale_axes must be a non-empty tuple of distinct int "
                             f"axes, got {axes!r}")
        for a in axes:
            check_axis(a, f"{name}.scale_axes")
        if fmt.channel_axis is not None:
            raise ValueError(f"{name}: give channel_axis or scale_axes, not both "
                             f"(got {fmt.channel_axis!r} and {axes!r})")
    tile = fmt.tile
    if tile is not None:
        if isinstance(tile, list):
            object.__setattr__(fmt, "tile", tile := tuple(tile))
        sizes = tile if isinstance(tile, tuple) else (tile,)
        if not sizes or any(not isinstance(t, (int, np.integer)) or isinstance(t, bool)
                            or t < 1 for t in sizes):
            raise ValueError(f"{name}.tile must be an int >= 1 or a tuple of them, got {tile!r}")
        if axes is None or len(sizes) > len(axes):
            raise ValueError(f"{name}.tile={tile!r} needs as many scale_axes (the last "
                             f"len(tile) are tiled), got scale_axes={axes!r}")


def tile_sizes(fmt) -> tuple[int, ...]:
    """The tile's size along each tiled axis (the last ``len`` of ``fmt.scale_axes``)."""
    tile = getattr(fmt, "tile", None)
    if tile is None:
        return ()
    return tuple(int(t) for t in (tile if isinstance(tile, tuple) else (tile,)))


def scale_elements(fmt) -> int:
    """Elements that share one scale in a tile of `fmt` (0 when it is not tiled)."""
    sizes = tile_sizes(fmt)
    return int(np.prod(sizes)) if sizes else 0


def scale_reduction_axes(ndim: int, fmt) -> tuple | None:
    """The axes one scale of `fmt` spans (None: all of them, one scale per tensor):
    ``scale_axes`` when given, else every axis but ``channel_axis``.

    Example:
      >>> from cpt_jax.formats import SymmetricInt
      >>> scale_reduction_axes(3, SymmetricInt(scale_axes=(-1,))), reduce_axes(3, -1)
      ((2,), (0, 1))
    """
    axes = getattr(fmt, "scale_axes", None)
    if axes is None or ndim == 0:
        return reduce_axes(ndim, fmt.channel_axis)
    return tuple(sorted(normal_axis(ndim, a, "scale_axes") for a in axes))


def scaled_statistic(x: Array, fmt, reduce):
    """``reduce(x, axes)`` per scale group of `fmt`: per tensor, channel, scale axes or tile.

    Untiled: ``reduce(x, scale_reduction_axes)`` (keepdims, broadcastable to `x`).
    Tiled: each tiled axis (the last ``len(tile)`` of ``scale_axes``) is split into
    blocks of ``tile`` elements, its last block padded with its own edge values (so
    min / max / max-abs are those of the real elements); one statistic per block and
    per index of the axes not in ``scale_axes``, broadcast back to ``x.shape``.
    `reduce` returns an array or a tuple of arrays.
    """
    sizes = tile_sizes(fmt)
    if not sizes or x.ndim == 0:
        return reduce(x, scale_reduction_axes(x.ndim, fmt))
    axes = [normal_axis(x.ndim, a, "scale_axes") for a in fmt.scale_axes]
    tiled = axes[-len(sizes):]
    view, inner, restore = block_view(x, list(zip(tiled, sizes)), pad_mode="edge")
    lead = [d for d in range(x.ndim) if d not in tiled]
    view_axes = tuple(sorted(inner + tuple(lead.index(a) for a in axes if a not in tiled)))
    out = reduce(view, view_axes)
    return jax.tree.map(lambda s: restore(jnp.broadcast_to(s, view.shape)), out)


def normal_axis(ndim: int, axis: int, name: str = "axis") -> int:
    """`axis` as an index in ``[0, ndim)``; ValueError naming `name` if out of range."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim


def block_view(x: Array, axes_sizes: Sequence[tuple], pad_mode: str = "constant") -> tuple:
    """`x` reshaped so each block is a set of inner dims: ``(view, inner_axes, restore)``.

    Each ``(axis, size)`` splits `axis` into ``(n_blocks, size)`` after padding it to
    a multiple of `size` (zeros; ``pad_mode="edge"`` repeats the last element, which
    leaves a block's min and max unchanged); `inner_axes` are the ``size`` dims of `view` (reduce
    over them for one value per block); ``restore(view)`` undoes the reshape, the
    padding and the transpose.

    Example:
      >>> v, inner, restore = block_view(jnp.arange(5.0), [(0, 2)])
      >>> v.shape, inner, restore(v).shape
      ((3, 2), (1,), (5,))
    """
    axes = [a for a, _ in axes_sizes]
    perm = [d for d in range(x.ndim) if d not in axes] + axes
    xt = jnp.transpose(x, perm)
    n_lead = x.ndim - len(axes)
    pads = [(0, 0)] * n_lead + [(0, (-xt.shape[n_lead + i]) % size)
                                for i, (_, size) in enumerate(axes_sizes)]
    xp = jnp.pad(xt, pads, mode=pad_mode) if any(p for _, p in pads) else xt
    shape = list(xp.shape[:n_lead])
    for i, (_, size) in enumerate(axes_sizes):
        shape += [xp.shape[n_lead + i] // size, size]
    view = xp.reshape(shape)
    inner = tuple(n_lead + 2 * i + 1 for i in range(len(axes)))
    inverse = tuple(int(i) for i in np.argsort(perm))

    def restore(v):
        y = v.reshape(xp.shape)[tuple(slice(0, n) for n in xt.shape)]
        return jnp.transpose(y, inverse)

    return view, inner, restore


def masked_absmax(x: Array, axes) -> Array:
    """``max |x|`` over the finite elements of `x` over `axes` (0 if none), as size-1 dims.

    One masked reduction, as the block-scaled formats compute their block maxima.
    """
    return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=axes, keepdims=True)


def fp_scale(amax: Array, largest: float) -> Array:
    """The scale of a scaled FP format: ``s = max(amax / largest, 2^-126)`` (1 if amax = 0).

    The floor keeps ``s`` a normal float32: below it ``amax / largest`` would be
    flushed to 0 on CPU and ``x / s`` would be NaN; elements that small round to 0.

    Example:
      >>> fp_scale(jnp.float32(896.0), 448.0), fp_scale(jnp.float32(1e-37), 448.0)
      (Array(2., dtype=float32), Array(1.1754944e-38, dtype=float32))
    """
    tiny = jnp.finfo(jnp.float32).tiny
    return jnp.where(amax > 0, jnp.maximum(amax / largest, tiny), 1.0)
