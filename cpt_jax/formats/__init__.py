"""Number formats: frozen descriptions of a grid, applied by one `quantize` function.

A format describes *which* values are representable at a given word length; the
word length itself (`bits`) is data, so it may be a traced value inside `jit` and a
whole cyclic-precision run compiles once. Every format follows the same contract:

* `bits >= 32` means full precision: the input is returned unchanged.
* Nearest rounding is round-half-to-even; stochastic rounding is
  `floor(v + U[0, 1))`, unbiased: `E[q(v)] = v` inside the range.
* Non-finite inputs pass through unchanged (NaN stays NaN, +-Inf stays +-Inf) and do
  not take part in computing ranges, scales or shared exponents, so one overflowed
  element cannot turn a whole tensor into NaN, and a caller can still detect it.
* A constant tensor (zero range) and an all-zero tensor are returned exactly: no
  NaN is ever created by a zero range or a zero maximum.
* Every grid is finite on finite inputs, up to ``+-3.4e38``: a range wider than
  float32 (`affine_grid`), a top code one ulp past the maximum, or a scale below the
  smallest normal float32 (`fp_scale`) is handled, never turned into Inf or NaN.

Formats:

=================  ==========================================================
`AffineInt`        CPT's min-max grid: ``s = max((max-min)/(2^b-1), 1e-8)``,
                   ``q = clip(round((x-min)/s), 0, 2^b-1) * s + min``.
`SymmetricInt`     max-abs grid: ``s = max|x| / (2^(b-1)-1)``,
                   ``q = clip(round(x/s), -(2^(b-1)-1), 2^(b-1)-1) * s``.
`FixedPoint`       QPyTorch fixed point, word ``b``, ``f`` fractional bits:
                   ``q = clip(round(x 2^f) 2^-f, -2^(b-f-1), 2^(b-f-1) - 2^-f)``.
`BlockFloat`       QPyTorch block floating point: shared exponent
                   ``e = floor(log2 max|x|)``, unit ``u = 2^(e+2-b)``,
                   ``q = u * clip(round(x/u), -(2^(b-1)-1), 2^(b-1)-1)``.
`Float`            small float with ``exp_bits`` exponent and ``b-1-exp_bits``
                   mantissa bits, QPyTorch semantics (no Inf/NaN codes, so the top
                   exponent is usable; saturating; subnormals).
`Quantizer`        any format as element x scaling: ``q = s * elem(x / s)``,
                   `IntElement` / `FixedElement` / `FloatElement` times a `Scaling`
                   (max-abs or min-max, per tensor / channel / axes / tile, scale
                   fp32 / pow2 / e8m0); `as_quantizer` writes a named one so.
=================  ==========================================================

Every format, built-in or not, is an object with a ``grid(x, bits, rounding, key)``
method and optional ``check_bits``, ``element_width``, ``bits_per_element``,
``traits``, ``along``, ``grid_step``, ``representable_range`` (`FormatProtocol`):
`quantize`, `bits_per_element` (the cost), `format_traits` and `along_contraction`
ask the format, never its type. `register_format` names a class here.

Modules (private to the package: import every name from `cpt_jax.formats`):

=================  ==========================================================
`_protocol`        `FormatProtocol` (the methods a format has), `FormatTraits`,
                   `Contraction`, `register_format`.
`_elements`        OCP element types (`ELEMENTS`), exact ``2^k`` math,
                   `float_elements` (any small-float element grid).
`_rounding`        ``"nearest"`` / ``"stochastic"`` rounding, `dither_noise` (its
                   cheap dither), `uniform_noise`.
`_cpu_guard`       finite ranges cheaply on CPU, a stochastic quantizer written
                   once (`guarded_on_cpu`).
`_scaling`         finite ranges, `prescale`, `affine_grid`, `fp_scale`,
                   `block_view`: how every scale is computed.
`_int_codes`       `IntCodes`: an integer format's codes plus scales, `decode`,
                   `bits_per_element`; `encode_affine`, `encode_symmetric`.
`_axis_scaled`     `AxisScaled` (a range per tensor / channel / axes / tile, the
                   base of the range formats and of `Scaling`), `repr_without_defaults`.
`_named`           the papers' formats (`AffineInt`, `SymmetricInt`, `BlockFloat`:
                   `RangeFormat`; `FixedPoint`, `Float`), each with its methods.
`_blocks`          the hardware formats' parts: elements, block scales, views.
`_scaled`          `OCPFloat`, `ScaledFloat` (the FP8 recipes), `scaled_codes`.
`_hardware`        `MX`, `NVFP4`.
`_composed`        `Quantizer` = element x `Scaling`, `as_quantizer` (named ->
                   composed, bit for bit).
`_quantize`        `quantize`, `FORMATS`, `Format`, `check_format`, `encode`
                   (checked integer codes), `symmetric_codes`.
`_measures`        `element_width`, `bits_per_element`, `grid_step`,
                   `representable_range`: asked of the format.
`_traits`          `format_traits`, `along_contraction` and the predicates:
                   what a caller asks of a format instead of its type.
=================  ==========================================================
"""

from cpt_jax.formats._axis_scaled import repr_without_defaults
from cpt_jax.formats._blocks import (
    mx_element_params,
    mx_parts,
    mx_shared_exponent,
    nvfp4_parts,
    nvfp4_view,
    scaled_float_parts,
)
from cpt_jax.formats._composed import (
    RANGES,
    SCALE_FORMATS,
    FixedElement,
    FloatElement,
    IntElement,
    Quantizer,
    Scaling,
    as_quantizer,
)
from cpt_jax.formats._cpu_guard import FAST_REDUCTION_MIN_SIZE
from cpt_jax.formats._elements import (
    ELEMENTS,
    MX_ELEMENTS,
    MX_FLOAT_BY_BITS,
    ElementSpec,
    float_elements,
    floor_log2,
    mul_pow2,
    pow2,
)
from cpt_jax.formats._hardware import HARDWARE_FORMATS, MX, MX_SCALE_ROUNDINGS, NVFP4
from cpt_jax.formats._int_codes import INT_CODE_KINDS, IntCodes, encode_affine, encode_symmetric
from cpt_jax.formats._measures import (
    bits_per_element,
    element_width,
    grid_step,
    representable_range,
)
from cpt_jax.formats._named import (
    TILE_SCALE_BITS,
    AffineInt,
    Array,
    Bits,
    BlockFloat,
    FixedPoint,
    Float,
    SymmetricInt,
)
from cpt_jax.formats._protocol import (
    FAMILIES,
    FP8_ELEMENTS,
    NOT_A_FORMAT,
    RANGE_GRIDS,
    SCALES,
    Contraction,
    FormatProtocol,
    FormatTraits,
    is_format,
    named_formats,
    register_format,
    unregister_format,
)
from cpt_jax.formats._quantize import (
    FORMATS,
    Format,
    check_bits,
    check_format,
    check_format_bits,
    encode,
    is_custom_format,
    quantize,
    symmetric_codes,
)
from cpt_jax.formats._rounding import (
    ROUNDINGS,
    check_rounding,
    dither_bits,
    dither_noise,
    round_to_integer,
    uniform_noise,
)
from cpt_jax.formats._scaled import SCALED_GRANULARITIES, OCPFloat, ScaledFloat, scaled_codes
from cpt_jax.formats._scaling import (
    MIN_SCALE,
    affine_grid,
    block_view,
    check_scaling,
    finite_absmax,
    finite_min_max,
    fp_scale,
    masked_absmax,
    normal_axis,
    plain_absmax,
    plain_min_max,
    prescale,
    reduce_axes,
    scale_elements,
    scale_reduction_axes,
    scaled_statistic,
    symmetric_scale,
    tile_sizes,
)
from cpt_jax.formats._traits import (
    along_contraction,
    format_traits,
    has_fp8_codes,
    is_blocked,
    is_per_tensor_scaled,
)

# The helpers' names from when this package was one module, still importable.
_FAST_REDUCTION_MIN_SIZE = FAST_REDUCTION_MIN_SIZE
_finite_absmax = finite_absmax
_finite_min_max = finite_min_max
_masked_absmax = masked_absmax
_normal_axis = normal_axis
_reduce_axes = reduce_axes
_round = round_to_integer
_symmetric_scale = symmetric_scale

__all__ = (
    "AffineInt",
    "Array",
    "Bits",
    "BlockFloat",
    "ELEMENTS",
    "FAMILIES",
    "ElementSpec",
    "FORMATS",
    "FP8_ELEMENTS",
    "FormatTraits",
    "FixedElement",
    "FixedPoint",
    "Float",
    "FloatElement",
    "Format",
    "FormatProtocol",
    "Contraction",
    "HARDWARE_FORMATS",
    "INT_CODE_KINDS",
    "IntCodes",
    "IntElement",
    "MIN_SCALE",
    "MX",
    "MX_ELEMENTS",
    "MX_FLOAT_BY_BITS",
    "MX_SCALE_ROUNDINGS",
    "NOT_A_FORMAT",
    "NVFP4",
    "OCPFloat",
    "Quantizer",
    "RANGES",
    "RANGE_GRIDS",
    "ROUNDINGS",
    "SCALED_GRANULARITIES",
    "SCALES",
    "SCALE_FORMATS",
    "Scaling",
    "ScaledFloat",
    "SymmetricInt",
    "TILE_SCALE_BITS",
    "affine_grid",
    "along_contraction",
    "as_quantizer",
    "bits_per_element",
    "block_view",
    "check_bits",
    "check_format",
    "check_format_bits",
    "check_rounding",
    "check_scaling",
    "element_width",
    "encode",
    "encode_affine",
    "encode_symmetric",
    "float_elements",
    "floor_log2",
    "format_traits",
    "fp_scale",
    "grid_step",
    "has_fp8_codes",
    "is_blocked",
    "is_custom_format",
    "is_format",
    "named_formats",
    "register_format",
    "unregister_format",
    "is_per_tensor_scaled",
    "masked_absmax",
    "mul_pow2",
    "mx_element_params",
    "mx_parts",
    "mx_shared_exponent",
    "nvfp4_parts",
    "nvfp4_view",
    "pow2",
    "prescale",
    "quantize",
    "repr_without_defaults",
    "representable_range",
    "round_to_integer",
    "scale_elements",
    "scale_reduction_axes",
    "scaled_codes",
    "scaled_float_parts",
    "scaled_statistic",
    "plain_absmax",
    "plain_min_max",
    "symmetric_codes",
    "tile_sizes",
    "uniform_noise",
    "dither_bits",
    "dither_noise",
)


def __getattr__(name: str):
    """A format class `register_format` named (``cpt_jax.formats.NormalFloat``)."""
    cls = named_formats().get(name)
    if cls is None:
        raise AttributeError(f"module 'cpt_jax.formats' has no attribute {name!r}")
    return cls


def __dir__():
    return sorted(set(globals()) | set(named_formats()))
