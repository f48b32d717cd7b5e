"""The named formats: frozen dataclasses that describe a grid, and their checks.

A format is data: which values are representable, given a word length that is not
part of it (`quantize` takes ``bits``). The papers' formats (`AffineInt`,
`SymmetricInt`, `FixedPoint`, `BlockFloat`, `Float`) and the hardware ones
(`OCPFloat`, `MX`, `NVFP4`, `ScaledFloat`: `HARDWARE_FORMATS`) make up `FORMATS`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from cpt_jax.formats._elements import ELEMENTS, MX_ELEMENTS, ElementSpec
from cpt_jax.formats._protocol import is_custom_format
from cpt_jax.formats._scaling import check_axis, check_scaling

Array = jax.Array
Bits = int | float | Array


@dataclasses.dataclass(frozen=True)
class AxisScaled:
    """The scaling of the papers' range formats (`AffineInt`, `SymmetricInt`,
    `BlockFloat`): one range per tensor (the default), per index along
    ``channel_axis``, or per group of ``scale_axes`` and per ``tile`` of them
    (`cpt_jax.formats.check_scaling`). Not a format itself."""

    channel_axis: int | None = None
    scale_axes: tuple[int, ...] | None = None
    tile: int | tuple[int, ...] | None = None

    def __post_init__(self):
        check_scaling(self)

    def __repr__(self):
        return repr_without_defaults(self, ("channel_axis",))


@dataclasses.dataclass(frozen=True, repr=False)
class AffineInt(AxisScaled):
    """CPT's affine min-max integer grid on ``[0, 2^b - 1]``.

    ``s = max((max - min) / (2^b - 1), 1e-8)``,
    ``q = clip(round((x - min) / s), 0, 2^b - 1) * s + min``.

    `channel_axis=None` uses one (min, max) for the whole tensor; an int keeps one
    range per index along that axis (e.g. ``-1`` for the output channel of a Dense
    kernel ``(in, out)`` or a conv kernel ``HWIO``). `scale_axes` and `tile` scale
    per any tuple of axes and per tile (`check_scaling`: per token, 1x128 tiles, ...).

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([0., 0.3, 1.]), 2, AffineInt())
      Array([0.        , 0.33333334, 1.        ], dtype=float32)
    """


@dataclasses.dataclass(frozen=True, repr=False)
class SymmetricInt(AxisScaled):
    """Symmetric max-abs integer grid, levels ``-(2^(b-1)-1)..2^(b-1)-1``.

    ``s = max(max|x| / (2^(b-1) - 1), 1e-8)``, ``q = clip(round(x / s), -L, L) * s``
    with ``L = 2^(b-1) - 1``. The integer codes ``round(x/s)`` fit a real int8 at
    ``b <= 8``. At ``b = 1`` there is no nonzero level and the result is all zeros.

    Scales per tensor, per index along `channel_axis`, or per `scale_axes` / `tile`.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([-1., 0.2, 0.7]), 2, SymmetricInt())
      Array([-1.,  0.,  1.], dtype=float32)
      >>> x = jnp.array([[1.0, 0.4], [0.01, 0.004]])   # two tokens, far apart
      >>> quantize(x, 4, SymmetricInt(scale_axes=(-1,)))  # one scale per token (row)
      Array([[1.        , 0.42857146],
             [0.01      , 0.00428571]], dtype=float32)
    """


@dataclasses.dataclass(frozen=True)
class FixedPoint:
    """QPyTorch fixed point: word length ``b`` (traced), ``frac_bits`` fractional bits.

    Unit ``2^-f``; range ``[-2^(b-f-1), 2^(b-f-1) - 2^-f]``; round first, then
    saturate: ``q = clip(round(x 2^f) 2^-f, lo, hi)``.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([0.3, 5.0]), 4, FixedPoint(frac_bits=2))
      Array([0.25, 1.75], dtype=float32)
    """

    frac_bits: int = 4

    def __post_init__(self):
        if not isinstance(self.frac_bits, (int, np.integer)) or self.frac_bits < 0:
            raise ValueError(f"FixedPoint.frac_bits must be an int >= 0, got {self.frac_bits!r}")


@dataclasses.dataclass(frozen=True, repr=False)
class BlockFloat(AxisScaled):
    """QPyTorch block floating point with word length ``b`` and one shared exponent.

    ``e = floor(log2 max|x|)`` over the block (the tensor, or each index along
    `channel_axis`), unit ``u = 2^(e + 2 - b)``,
    ``q = u * clip(round(x / u), -(2^(b-1) - 1), 2^(b-1) - 1)``.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([1.0, 0.3, -0.05]), 4, BlockFloat())
      Array([ 1.  ,  0.25, -0.  ], dtype=float32)
    """


@dataclasses.dataclass(frozen=True)
class Float:
    """Small float: 1 sign, ``exp_bits`` exponent, ``m = b - 1 - exp_bits`` mantissa bits.

    QPyTorch semantics: bias ``2^(E-1) - 1``; no Inf/NaN codes, so the largest
    exponent is ``2^(E-1)`` (one more than IEEE) and the maximum is
    ``2^(2^(E-1)) (2 - 2^-m)``; values beyond it saturate; subnormals below
    ``2^(1-bias)`` have spacing ``2^(1-bias-m)``. Rounding is to the nearest
    representable value, half to even (QPyTorch's CUDA kernel rounds half away
    from zero; ties are measure-zero for real data).

    e4m3 is ``Float(4)`` at 8 bits: max 480, smallest subnormal 2^-9.
    e5m2 is ``Float(5)`` at 8 bits: max 114688, smallest subnormal 2^-16.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([1000., 0.1]), 8, Float(exp_bits=4)).tolist()
      [480.0, 0.1015625]
    """

    exp_bits: int = 4

    def __post_init__(self):
        if not isinstance(self.exp_bits, (int, np.integer)) or not 1 <= self.exp_bits <= 8:
            raise ValueError(f"Float.exp_bits must be an int in [1, 8], got {self.exp_bits!r}")

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

# --------------------------------------------------------------------------- hardware formats

SCALED_GRANULARITIES = ("tensor", "row", "tile", "block")

MX_SCALE_ROUNDINGS = ("floor", "up")
"""`MX.scale_rounding`: the OCP spec's floor, or JAX's / cuDNN's round-up of ``amax / max``."""


_check_axis = check_axis


def repr_without_defaults(obj, always: Sequence[str]) -> str:
    """``Name(f=v, ...)``: the fields in `always`, then the others that differ from
    their defaults (so a format's repr is unchanged by a new option left at its default).

    Example:
      >>> repr_without_defaults(MX("e2m1", scale_rounding="up"), ("element",))
      "MX(element='e2m1', scale_rounding='up')"
    """
    parts = []
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.name in always or value != field.default:
            parts.append(f"{field.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


@dataclasses.dataclass(frozen=True)
class OCPFloat:
    """An OCP element type as a saturating cast: ``q = dtype(clip(x, -max, max))``.

    Elements (OCP OFP8 spec v1.0 and OCP Microscaling spec v1.0, section 5.3):
    ``"e4m3"`` (float8_e4m3fn, max 448), ``"e5m2"`` (max 57344), ``"e3m2"``
    (float6_e3m2fn, max 28), ``"e2m3"`` (float6_e2m3fn, max 7.5), ``"e2m1"``
    (float4_e2m1fn, max 6). No scale: values are cast as they are, so this is the
    element grid itself; the width is the element's and any ``bits < 32`` gives it
    (``bits >= 32``: identity). Nearest rounding is half to even, as ml_dtypes.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([1000., 0.3, -17.]), 8, OCPFloat("e4m3")).tolist()
      [448.0, 0.3125, -16.0]
    """

    element: str = "e4m3"

    def __post_init__(self):
        if self.element not in ELEMENTS:
            raise ValueError(f"OCPFloat.element must be one of {tuple(ELEMENTS)}, got {self.element!r}")

    @property
    def spec(self) -> ElementSpec:
        return ELEMENTS[self.element]


@dataclasses.dataclass(frozen=True)
class MX:
    """OCP Microscaling (MX spec v1.0): blocks of `block_size` share a power-of-two scale.

    Consecutive blocks of `block_size` elements along `axis` (zero-padded at the
    end) share ``X = 2^clip(floor(log2 amax) - emax_elem, -127, 127)`` (an E8M0
    scale); elements are the saturating casts of ``x / X``; ``q = X * elem``.

    * ``"e4m3" "e5m2" "e3m2" "e2m3" "e2m1"``: MXFP8/MXFP6/MXFP4, ``emax_elem`` =
      8, 15, 4, 2, 2 (`OCPFloat` elements).
    * ``"int8"``: MXINT8, ``elem = clip(rint(64 x/X), -127, 127) / 64``, emax 0.
    * ``"int"`` (traced width ``b``, 2..8 are the MX widths):
      ``elem = clip(rint(2^(b-2) x/X), -(2^(b-1)-1), 2^(b-1)-1) / 2^(b-2)``
      (MXINT8 at 8).
    * ``"float"`` (traced width): bits 4/6/8 use e2m1/e2m3/e4m3; between them the
      widest element not above ``bits`` (5 -> e2m1, 7 -> e2m3).

    `axis` should be the dimension the product contracts (see docs/formats.md).

    `scale_rounding` picks the shared exponent of a float element:

    * ``"floor"`` (the OCP spec, section 6.3): ``floor(log2 amax) - emax_elem``;
      the block's largest element can exceed the element's maximum and saturate
      (e4m3: amax in ``[448, 512) * X``).
    * ``"up"`` (JAX's ``jax.nn.get_scaled_dot_general_config`` and cuDNN):
      ``X = 2^ceil(log2(amax / largest))``, the E8M0 cast of ``amax / largest``
      rounded up: nothing saturates, the largest element may use one binade less.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([3.0, 0.26, -0.1, 0.0]), 4, MX("e2m1", block_size=4)).tolist()
      [3.0, 0.25, -0.0, 0.0]
      >>> x = jnp.array([500.0, 1.0])      # floor: X = 1, 500 saturates; up: X = 2
      >>> [quantize(x, 8, MX(block_size=2, scale_rounding=r)).tolist() for r in ("floor", "up")]
      [[448.0, 1.0], [512.0, 1.0]]
    """

    element: str = "e4m3"
    block_size: int = 32
    axis: int = -1
    scale_rounding: str = dataclasses.field(default="floor", repr=False)

    def __post_init__(self):
        if self.element not in MX_ELEMENTS:
            raise ValueError(f"MX.element must be one of {MX_ELEMENTS}, got {self.element!r}")
        if not isinstance(self.block_size, (int, np.integer)) or self.block_size < 1:
            raise ValueError(f"MX.block_size must be an int >= 1, got {self.block_size!r}")
        _check_axis(self.axis, "MX.axis")
        if self.scale_rounding not in MX_SCALE_ROUNDINGS:
            raise ValueError(f"MX.scale_rounding must be one of {MX_SCALE_ROUNDINGS}, "
                             f"got {self.scale_rounding!r}")
        if self.scale_rounding == "up" and self.element in ("int8", "int"):
            raise ValueError(f"MX.scale_rounding='up' needs a float element, got "
                             f"{self.element!r}")

    def __repr__(self) -> str:
        return repr_without_defaults(self, ("element", "block_size", "axis"))


@dataclasses.dataclass(frozen=True)
class NVFP4:
    """NVIDIA NVFP4: e2m1 elements, blocks of 16 with an E4M3 scale, an fp32 tensor scale.

    As NVIDIA describes it (NVIDIA Technical Blog, "Introducing NVFP4 for
    Efficient and Accurate Low-Precision Inference", 2025; Transformer Engine's
    NVFP4 recipe): ``s_t = 448 * 6 / amax(x)`` (fp32, per tensor; 1 if amax is 0);
    per block of 16 along `axis` ``s_b = e4m3(amax_b / 6 * s_t)`` (the stored
    E4M3 scale, round to nearest); ``q = e2m1(x / (s_b / s_t)) * s_b / s_t``
    (saturating; a block whose scale rounds to 0 becomes 0). The width is 4;
    ``bits >= 32`` is identity.

    ``block_2d=True`` (the NVFP4 *training* recipe's weights, NVIDIA "Pretraining
    Large Language Models with NVFP4", 2025): blocks of 16 x 16 over `axis` and
    `other_axis` (default: the last axis that is not `axis`), so a weight and its
    transpose are quantized to the same values; a 1-D tensor keeps 1 x 16 blocks.

    Example:
      >>> from cpt_jax.formats import quantize
      >>> quantize(jnp.array([6.0, 1.1, -0.4, 0.0]), 4, NVFP4())
      Array([ 6. ,  1. , -0.5,  0. ], dtype=float32)
      >>> w = jax.random.normal(jax.random.key(0), (32, 48))
      >>> q = quantize(w, 4, NVFP4(axis=0, block_2d=True))
      >>> bool(jnp.all(q.T == quantize(w.T, 4, NVFP4(axis=0, block_2d=True))))
      True
    """

    axis: int = -1
    block_size: int = 16
    block_2d: bool = dataclasses.field(default=False, repr=False)
    other_axis: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        _check_axis(self.axis, "NVFP4.axis")
        if self.block_size != 16:
            raise ValueError(f"NVFP4.block_size is 16 (NVIDIA's format), got {self.block_size!r}")
        if not isinstance(self.block_2d, (bool, np.bool_)):
            raise ValueError(f"NVFP4.block_2d must be a bool, got {self.block_2d!r}")
        if self.other_axis is not None:
            _check_axis(self.other_axis, "NVFP4.other_axis")

    def __repr__(self) -> str:
        return repr_without_defaults(self, ("axis", "block_size"))


@dataclasses.dataclass(frozen=True)
class ScaledFloat:
    """An OCP float element with an fp32 scale ``X = amax / max``: the FP8 training recipes.

    ``q = X * dtype(x / X)`` (saturating), ``X = amax / largest`` over a group
    (``X = 1`` where amax is 0), with `granularity`:

    * ``"tensor"``: one scale (Transformer Engine's per-tensor current scaling);
    * ``"row"``: one scale per slice along `axis` (rowwise: amax over the
      contracted dimension, one scale per row of the operand);
    * ``"tile"``: blocks of ``1 x tile`` along `axis` (DeepSeek-V3's activations);
    * ``"block"``: ``tile x tile`` blocks over `axis` and `other_axis` (default:
      the last axis that is not `axis`; DeepSeek-V3's 128x128 weight blocks).

    Example:
      >>> from cpt_jax.formats import quantize
      >>> q = quantize(jnp.array([1000., 0.3, -17.]), 8, ScaledFloat("e4m3"))
      >>> [round(v, 3) for v in q.tolist()]  # scale 1000/448; 0.3 -> 9/64 * 1000/448
      [1000.0, 0.314, -16.741]
    """

    element: str = "e4m3"
    granularity: str = "tensor"
    axis: int = -1
    tile: int = 128
    other_axis: int | None = None

    def __post_init__(self):
        if self.element not in ELEMENTS:
            raise ValueError(f"ScaledFloat.element must be one of {tuple(ELEMENTS)}, got {self.element!r}")
        if self.granularity not in SCALED_GRANULARITIES:
            raise ValueError(f"ScaledFloat.granularity must be one of {SCALED_GRANULARITIES}, "
                             f"got {self.granularity!r}")
        _check_axis(self.axis, "ScaledFloat.axis")
        if self.other_axis is not None:
            _check_axis(self.other_axis, "ScaledFloat.other_axis")
        if not isinstance(self.tile, (int, np.integer)) or self.tile < 1:
            raise ValueError(f"ScaledFloat.tile must be an int >= 1, got {self.tile!r}")

    @property
    def spec(self) -> ElementSpec:
        return ELEMENTS[self.element]


Format = (AffineInt | SymmetricInt | FixedPoint | BlockFloat | Float | OCPFloat | MX | NVFP4
          | ScaledFloat)
FORMATS = (AffineInt, SymmetricInt, FixedPoint, BlockFloat, Float, OCPFloat, MX, NVFP4,
           ScaledFloat)
HARDWARE_FORMATS = (OCPFloat, MX, NVFP4, ScaledFloat)


def check_format(fmt: Any) -> None:
    """Raise ValueError unless `fmt` is an instance of one of `FORMATS` or a format by
    `cpt_jax.formats.FormatProtocol` (an object with a ``grid`` method)."""
    if type(fmt) not in FORMATS and not is_custom_format(fmt):
        raise ValueError(
            f"fmt must be one of {[f.__name__ for f in FORMATS]}, got {fmt!r}")
