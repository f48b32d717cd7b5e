"""Quantization configuration: which format and rounding each tensor of an op uses.

A `QuantConfig` describes one quantized dot/conv: its weight (the kernel, right-hand
operand), its activation (the input, left-hand operand) and its error (the cotangent
of its output). The default is CPT's recipe (Fu et al. 2021):

* weights: `AffineInt` per output channel, nearest rounding, forward bits;
* activations: `AffineInt` per tensor, nearest rounding, forward bits;
* errors: `AffineInt` per tensor, stochastic rounding, backward bits.

A tensor set to None stays in full precision. `bits_offset` shifts this op's
forward bits relative to the context's (per-layer allocation), `grad_bits_offset`
its backward bits; the result is clipped to ``[1, 32]``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp

from cpt_jax import formats
from cpt_jax.formats import (
    MX,
    NVFP4,
    AffineInt,
    BlockFloat,
    Format,
    ScaledFloat,
    SymmetricInt,
)
from cpt_jax.registry import Registry

ACTIVATION_RANGES = ("batch", "running")
AUTO = "auto"
"""``QuantConfig.compute="auto"``: the provider the formats and the platform ask for."""
GEMM_COMPUTES = ("real", "fake")
GEMM_SCALINGS = ("current", "delayed")


@dataclasses.dataclass(frozen=True)
class TensorQuant:
    """How one tensor is quantized: a number format and a rounding mode."""

    fmt: Format = AffineInt()
    rounding: str = "nearest"

    def __post_init__(self):
        formats.check_format(self.fmt)
        if self.rounding not in formats.ROUNDINGS:
            raise ValueError(
                f"TensorQuant.rounding must be one of {formats.ROUNDINGS}, got {self.rounding!r}")


@dataclasses.dataclass(frozen=True)
class LowpGemm:
    """Forward, input-gradient and weight-gradient GEMMs in low precision (`cpt_jax.providers.lowp_gemm`).

    Each GEMM quantizes its own two operands along its own contraction: ``y = x W``
    (x and W along ``K``), ``dx = g W^T`` (g and W along ``N``), ``dW = x^T g``
    (x and g along the tokens ``M``), as Transformer Engine does.

    Attributes:
      compute: ``"real"``: codes and scales into a low-precision GEMM (float8
        ``dot_general`` with fp32 accumulation, or ``jax.nn.scaled_matmul`` for
        block scales); ``"fake"``: the same quantized operands, dequantized, into a
        float32 GEMM (the reference the real path equals to float32 rounding).
      scaling: ``"current"`` (each tensor's own amax) or ``"delayed"``
        (per-tensor FP8: weight and activation scales from an amax history kept in
        ``batch_stats``; errors stay current).
      history_length: amax history length of delayed scaling.
      margin: delayed scaling's ``amax * 2^margin``.
      hadamard_size: random Hadamard transform of this size on both weight-gradient
        inputs along the tokens (NVFP4 training recipe: 16; 0: none).
      hadamard_seed: the fixed seed of the transform's random signs.
    """

    compute: str = "real"
    scaling: str = "current"
    history_length: int = 16
    margin: float = 0.0
    hadamard_size: int = 0
    hadamard_seed: int = 0

    def __post_init__(self):
        if self.compute not in GEMM_COMPUTES:
            raise ValueError(f"LowpGemm.compute must be one of {GEMM_COMPUTES}, got {self.compute!r}")
        if self.scaling not in GEMM_SCALINGS:
            raise ValueError(f"LowpGemm.scaling must be one of {GEMM_SCALINGS}, got {self.scaling!r}")
        if not isinstance(self.history_length, int) or self.history_length < 1:
            raise ValueError(f"LowpGemm.history_length must be an int >= 1, got "
                             f"{self.history_length!r}")
        h = self.hadamard_size
        if not isinstance(h, int) or h < 0 or (h and (h < 2 or h & (h - 1))):
            raise ValueError(f"LowpGemm.hadamard_size must be 0 or a power of two >= 2, got {h!r}")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Quantization of one dot/conv: weight, activation, error, offsets, how it computes.

    Attributes:
      weight: format of the kernel (None: full precision).
      activation: format of the input (None: full precision).
      error: format of the output's cotangent at the backward bits (None: fp32).
      bits_offset: added to the context's forward bits for this op.
      grad_bits_offset: added to the context's backward bits for this op.
      compute: the provider that computes the product, by name (`COMPUTES`;
        ``cpt_jax.register_provider`` adds more): ``"auto"`` (the default: the
        formats choose, and integer GEMMs run where the platform computes them faster
        than float32, `cpt_jax.providers.integer_gemm_platforms`), ``"fake"`` (fake
        quantization: quantized values, float32 GEMMs), ``"int"`` (all three GEMMs on
        int8 codes with int32 accumulation at widths <= 8: `AffineInt` /
        `SymmetricInt` weight and activation), ``"fp8"`` (the forward product on
        float8 codes with fp32 accumulation: per-tensor or per-row `ScaledFloat` /
        `OCPFloat` e4m3/e5m2 weight and activation, nearest).
      activation_range: ``"batch"``: each activation's own range; ``"running"``: a
        moving average of the training ranges, used in evaluation (CPT's
        QuantMeasure; per-tensor `AffineInt`/`SymmetricInt`; `cpt_jax.providers.running_ranges`).
      gemm: run all three GEMMs of each dot in low precision (`LowpGemm`,
        `cpt_jax.providers.lowp_gemm.LOWP_GEMM`; weight, activation and error in `OCPFloat`,
        `ScaledFloat`, `MX` with a float element or `NVFP4`).
    """

    weight: TensorQuant | None = TensorQuant(AffineInt(channel_axis=-1), "nearest")
    activation: TensorQuant | None = TensorQuant(AffineInt(), "nearest")
    error: TensorQuant | None = TensorQuant(AffineInt(), "stochastic")
    bits_offset: float = 0.0
    grad_bits_offset: float = 0.0
    compute: str = AUTO
    activation_range: str = "batch"
    gemm: LowpGemm | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        check_compute(self)
        if self.gemm is not None:
            check_lowp_gemm(self)
        if self.activation_range not in ACTIVATION_RANGES:
            raise ValueError(f"QuantConfig.activation_range must be one of {ACTIVATION_RANGES}, "
                             f"got {self.activation_range!r}")
        fmt = getattr(self.activation, "fmt", None)
        traits = formats.format_traits(fmt)
        if self.activation_range == "running" and (
                self.compute not in (AUTO, "fake")
                or traits.family not in ("affine_int", "symmetric_int")
                or traits.scale != "tensor"):
            raise ValueError("QuantConfig(activation_range='running') needs a per-tensor "
                             f"AffineInt or SymmetricInt activation and compute='auto' or "
                             f"'fake', got {fmt!r}, compute={self.compute!r}")

    def replace(self, **changes) -> QuantConfig:
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        fields = [f for f in dataclasses.fields(self) if f.name != "gemm" or self.gemm is not None]
        inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields)
        return f"{type(self).__name__}({inner})"


def check_fp8_compute(config: QuantConfig) -> None:
    """Raise ValueError unless `config`'s weight and activation can be float8 operands
    (``compute="fp8"``): `OCPFloat` or `ScaledFloat` ("tensor" / "row") with an e4m3/e5m2
    element, nearest."""
    for field in ("weight", "activation"):
        tq = getattr(config, field)
        fmt = getattr(tq, "fmt", None)
        ok = formats.has_fp8_codes(fmt) and tq.rounding == "nearest"
        if not ok:
            raise ValueError(
                f"QuantConfig(compute='fp8') needs {field} in OCPFloat or ScaledFloat "
                f"('tensor'/'row') with an e4m3/e5m2 element and nearest rounding, got {tq!r}")


def check_int_compute(config: QuantConfig) -> None:
    """Raise ValueError unless `config` can run integer GEMMs (``compute="int"``): an
    `AffineInt` or `SymmetricInt` weight and activation, batch activation ranges.

    Which products then run on int8 codes (untiled grids constant along the
    contraction; widths <= 8) and which fall back to fake quantization is the
    provider's (`cpt_jax.providers.integer`).

    Example:
      >>> QuantConfig(weight=TensorQuant(MX("e4m3")), compute="int")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: QuantConfig(compute='int') needs weight in AffineInt or SymmetricInt, got ...
    """
    for field in ("weight", "activation"):
        tq = getattr(config, field)
        family = formats.format_traits(getattr(tq, "fmt", None)).family
        if family not in ("affine_int", "symmetric_int"):
            raise ValueError(f"QuantConfig(compute='int') needs {field} in AffineInt or "
                             f"SymmetricInt, got {tq!r}")


@dataclasses.dataclass(frozen=True)
class ComputeSpec:
    """What a config-level name of `COMPUTES` checks and counts.

    Attributes:
      check: ``check(config)`` raises ValueError for a config this provider cannot
        compute (None: any config).
      operand_bits: ``operand_bits(config, bits, grad_bits) -> (b_w, b_a, b_g)``, the
        bits its operands cost (None: the formats' stored bits, `operand_bits`).
      doc: one line for tables and ``--help``.
    """

    check: Callable[[QuantConfig], None] | None = None
    operand_bits: Callable | None = None
    doc: str = ""


COMPUTES: dict[str, ComputeSpec] = {
    AUTO: ComputeSpec(doc="the formats choose; integer GEMMs where the platform runs them "
                          "faster than float32"),
    "fake": ComputeSpec(doc="fake quantization: quantized values, float32 GEMMs"),
    "int": ComputeSpec(check_int_compute, doc="all three GEMMs on int8 codes, int32 "
                                              "accumulation (widths <= 8)"),
    "fp8": ComputeSpec(check_fp8_compute, doc="the forward product on float8 codes, fp32 "
                                              "accumulation"),
}
"""The names ``QuantConfig.compute`` takes, with their checks (`register_compute`; a
provider registered by name with `cpt_jax.register_provider` adds its own)."""


def register_compute(name: str, spec: ComputeSpec) -> None:
    """Make `name` a valid ``QuantConfig.compute`` (ValueError if it is taken by another
    spec). Called by `cpt_jax.register_provider`.

    Example:
      >>> register_compute("fake", COMPUTES["fake"])       # the same spec again: no-op
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a compute name must be a non-empty str, got {name!r}")
    if name in COMPUTES and COMPUTES[name] != spec:
        raise ValueError(f"QuantConfig.compute={name!r} is already registered")
    COMPUTES[name] = spec


def check_compute(config: QuantConfig) -> None:
    """ValueError unless ``config.compute`` is a name of `COMPUTES` whose check passes."""
    spec = COMPUTES.get(config.compute) if isinstance(config.compute, str) else None
    if spec is None:
        raise ValueError(f"QuantConfig.compute must be one of {sorted(COMPUTES)}, got "
                         f"{config.compute!r}")
    if spec.check is not None:
        spec.check(config)


def gemm_capable(fmt) -> bool:
    """Whether a format has codes and scales a low-precision GEMM takes: `OCPFloat`,
    `ScaledFloat` (any granularity), `MX` with an OCP float element, `NVFP4`.

    Example:
      >>> gemm_capable(MX("e2m1")), gemm_capable(MX("int8")), gemm_capable(AffineInt())
      (True, False, False)
    """
    return formats.format_traits(fmt).element in formats.ELEMENTS


def gemm_block_size(fmt) -> int | None:
    """The block length along the contraction of a block-scaled format (None: unblocked).

    Example:
      >>> gemm_block_size(MX("e4m3")), gemm_block_size(NVFP4()), gemm_block_size(ScaledFloat())
      (32, 16, None)
    """
    return formats.format_traits(fmt).block_size


def check_lowp_gemm(config: QuantConfig) -> None:
    """Raise ValueError unless `config` can run its GEMMs in low precision (`LowpGemm`).

    Weight, activation and error (each may be None: that GEMM stays float32) must be
    `gemm_capable`, their block-scaled formats share one block length, and delayed
    scaling needs per-tensor `ScaledFloat` weight and activation with nearest rounding.

    Example:
      >>> check_lowp_gemm(get_preset("nvfp4_gemm"))   # the QuantConfig constructor calls it
      >>> QuantConfig(gemm=LowpGemm())  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: QuantConfig(gemm=...) needs weight in OCPFloat, ... got AffineInt(channel_axis=-1)
    """
    if config.compute != AUTO or config.activation_range != "batch":
        raise ValueError("QuantConfig(gemm=...) needs compute='auto' and "
                         f"activation_range='batch', got {config!r}")
    blocks = set()
    for field in ("weight", "activation", "error"):
        tq = getattr(config, field)
        if tq is None:
            continue
        if not gemm_capable(tq.fmt):
            raise ValueError(f"QuantConfig(gemm=...) needs {field} in OCPFloat, ScaledFloat, "
                             f"MX with a float element or NVFP4, got {tq.fmt!r}")
        if gemm_block_size(tq.fmt) is not None:
            blocks.add(gemm_block_size(tq.fmt))
    if len(blocks) > 1:
        raise ValueError(f"QuantConfig(gemm=...) needs one block length for weight, activation "
                         f"and error, got {sorted(blocks)}")
    if config.gemm.scaling == "delayed":
        for field in ("weight", "activation"):
            tq = getattr(config, field)
            fmt = getattr(tq, "fmt", None)
            if not (formats.is_per_tensor_scaled(fmt) and tq.rounding == "nearest"):
                raise ValueError(f"LowpGemm(scaling='delayed') needs {field} in per-tensor "
                                 f"ScaledFloat with nearest rounding, got {tq!r}")


# --------------------------------------------------------------------------- presets

def _same(fmt_forward, fmt_error, error_rounding="nearest", weight_fmt=None) -> QuantConfig:
    """Activation `fmt_forward`, weight `weight_fmt` (default: the same), error `fmt_error`."""
    return QuantConfig(weight=TensorQuant(weight_fmt or fmt_forward),
                       activation=TensorQuant(fmt_forward),
                       error=TensorQuant(fmt_error, error_rounding))


def _mx(element, error_element=None, error_rounding="nearest") -> QuantConfig:
    """MX blocks along the contraction: activations' features (-1), kernels' inputs (-2)."""
    return _same(MX(element), MX(error_element or element), error_rounding,
                 weight_fmt=MX(element, axis=-2))


BUILTIN_PRESETS = {
    "cpt": QuantConfig(),
    "int8": QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
                        activation=TensorQuant(SymmetricInt()),
                        error=TensorQuant(AffineInt(), "stochastic"), compute="int"),
    "symmetric": QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
                             activation=TensorQuant(SymmetricInt())),
    "symmetric_per_token": QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
                                       activation=TensorQuant(SymmetricInt(scale_axes=(-1,)))),
    "int8_per_token": QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
                                  activation=TensorQuant(SymmetricInt(scale_axes=(-1,))),
                                  error=TensorQuant(AffineInt(), "stochastic"), compute="int"),
    "symmetric_tile128": QuantConfig(
        weight=TensorQuant(SymmetricInt(scale_axes=(-2,), tile=128)),
        activation=TensorQuant(SymmetricInt(scale_axes=(-1,), tile=128)),
        error=TensorQuant(AffineInt(), "stochastic")),
    "int8_tile128": QuantConfig(weight=TensorQuant(SymmetricInt(scale_axes=(-2,), tile=128)),
                                activation=TensorQuant(SymmetricInt(scale_axes=(-1,), tile=128)),
                                error=TensorQuant(AffineInt(), "stochastic"), compute="int"),
    "block_float": QuantConfig(weight=TensorQuant(BlockFloat(), "stochastic"),
                               activation=TensorQuant(BlockFloat(), "stochastic"),
                               error=TensorQuant(BlockFloat(), "stochastic")),
    "fp8_tensor": _same(ScaledFloat("e4m3"), ScaledFloat("e5m2")),
    "fp8_delayed": _same(ScaledFloat("e4m3"), ScaledFloat("e5m2")),
    "fp8_compute": _same(ScaledFloat("e4m3"), ScaledFloat("e5m2")).replace(compute="fp8"),
    "fp8_rowwise": _same(ScaledFloat("e4m3", "row"), ScaledFloat("e5m2", "row"),
                         weight_fmt=ScaledFloat("e4m3", "row", axis=-2)),
    "fp8_blockwise": _same(ScaledFloat("e4m3", "tile"), ScaledFloat("e4m3", "tile"),
                           weight_fmt=ScaledFloat("e4m3", "block", axis=-2)),
    "mxfp8": _mx("e4m3", "e5m2"),
    "mxfp6": _mx("e2m3", "e3m2"),
    "mxfp4": _mx("e2m1", error_rounding="stochastic"),
    "mxint8": _mx("int8"),
    "nvfp4": _same(NVFP4(), NVFP4(), "stochastic", weight_fmt=NVFP4(axis=-2)),
    "mx_int": _mx("int", error_rounding="stochastic"),
    "mx_float": _mx("float", error_rounding="stochastic"),
    "fp8_gemm": _same(ScaledFloat("e4m3"), ScaledFloat("e5m2")).replace(gemm=LowpGemm()),
    "fp8_gemm_delayed": _same(ScaledFloat("e4m3"), ScaledFloat("e5m2")).replace(
        gemm=LowpGemm(scaling="delayed")),
    "fp8_gemm_rowwise": _same(ScaledFloat("e4m3", "row"), ScaledFloat("e5m2", "row"),
                              weight_fmt=ScaledFloat("e4m3", "row", axis=-2)).replace(
        gemm=LowpGemm()),
    "fp8_gemm_blockwise": _same(ScaledFloat("e4m3", "tile"), ScaledFloat("e4m3", "tile"),
                                weight_fmt=ScaledFloat("e4m3", "block", axis=-2)).replace(
        gemm=LowpGemm()),
    "mxfp8_gemm": _mx("e4m3", "e5m2").replace(gemm=LowpGemm()),
    "mxfp6_gemm": _mx("e2m3", "e3m2").replace(gemm=LowpGemm()),
    "mxfp4_gemm": _mx("e2m1", error_rounding="stochastic").replace(gemm=LowpGemm()),
    "nvfp4_gemm": QuantConfig(weight=TensorQuant(NVFP4(axis=-2, block_2d=True)),
                              activation=TensorQuant(NVFP4()),
                              error=TensorQuant(NVFP4(), "stochastic"),
                              gemm=LowpGemm(hadamard_size=16)),
}

"""The built-in recipes' configs, in the order `PRESETS` lists them (each registered
below with its doc in `BUILTIN_PRESET_DOCS`)."""

BUILTIN_PRESET_DOCS = {
    "cpt": "CPT (Fu et al. 2021): `AffineInt`, weights per output channel, errors "
           "stochastic; at the context's traced widths.",
    "int8": "`SymmetricInt` operands, all three GEMMs on int8 codes with int32 accumulation "
            "(``compute=\"int\"``, `cpt_jax.ops.integer_gemm`).",
    "symmetric": "`SymmetricInt` weights (per output channel) and activations, fake quant; "
                 "errors as ``cpt``.",
    "symmetric_per_token": "``symmetric`` with one activation scale per token (per row of "
                           "each GEMM: ``SymmetricInt(scale_axes=(-1,))``, laid along the "
                           "product's contraction).",
    "int8_per_token": "``int8`` with per-token activation scales: ``y[t, c] = s_x[t] s_w[c] "
                      "acc[t, c]`` (a conv falls back to fake quant).",
    "symmetric_tile128": "`SymmetricInt` with one scale per 128 contracted elements: 1x128 "
                         "activation tiles per token, 128x1 weight tiles per output channel "
                         "(``scale_axes`` + ``tile``), fake quant; errors as ``cpt``.",
    "int8_tile128": "the same grids in a real int8 product: one int32 partial sum per tile, "
                    "rescaled by both tiles' scales, summed (`tiled_int8_dot`).",
    "block_float": "`BlockFloat` (one shared exponent per tensor) everywhere, stochastic.",
    "fp8_tensor": "per-tensor current scaling (Transformer Engine): E4M3 weights and "
                  "activations, E5M2 errors, ``X = amax / max`` of the current tensor.",
    "fp8_delayed": "the ``fp8_tensor`` grids; activations scaled from their amax history "
                   "(Transformer Engine's delayed scaling): with ``provider=cpt_jax.providers."
                   "DelayedFP8Provider()`` (the main job's ``quantizer=\"fp8_delayed\"``); "
                   "without it, ``fp8_tensor``.",
    "fp8_compute": "``fp8_tensor`` with the forward product on float8 operands and fp32 "
                   "accumulation (`cpt_jax.providers.block_formats.FP8_COMPUTE`).",
    "fp8_rowwise": "FP8 with one scale per row: amax over the contracted axis.",
    "fp8_blockwise": "DeepSeek-V3: 1x128 activation and error tiles, 128x128 weight blocks, "
                     "E4M3 everywhere.",
    "mxfp8": "OCP MX v1.0 MXFP8: E4M3 in blocks of 32 along the contraction; errors E5M2.",
    "mxfp6": "OCP MX v1.0 MXFP6: E2M3 in blocks of 32 along the contraction; errors E3M2.",
    "mxfp4": "OCP MX v1.0 MXFP4: E2M1 in blocks of 32 along the contraction; errors E2M1, "
             "stochastic.",
    "mxint8": "OCP MX v1.0 MXINT8 in blocks of 32 along the contraction.",
    "nvfp4": "NVIDIA NVFP4 (e2m1, E4M3 scale per 16, fp32 per tensor), errors stochastic.",
    "mx_int": "MX(\"int\") at the traced width: a cyclic schedule over MX widths that "
              "compiles once; errors stochastic.",
    "mx_float": "MX(\"float\") at the traced width: 4/6/8-bit elements (e2m1 / e2m3 / e4m3); "
                "errors stochastic.",
    "fp8_gemm": "all three GEMMs in FP8 (`LowpGemm`, `cpt_jax.providers.lowp_gemm`): E4M3 "
                "weights and activations, E5M2 errors, per-tensor current scaling, float8 "
                "operands with fp32 accumulation.",
    "fp8_gemm_delayed": "``fp8_gemm`` with weight and activation scales from their amax "
                        "history.",
    "fp8_gemm_rowwise": "``fp8_gemm`` with one scale per row.",
    "fp8_gemm_blockwise": "``fp8_gemm`` with 1x128 tiles and 128x128 weight blocks "
                          "(DeepSeek-V3), block scales through ``scaled_matmul``.",
    "mxfp8_gemm": "``mxfp8``'s formats in three block-scaled GEMMs (``jax.nn.scaled_matmul``, "
                  "E8M0 scales).",
    "mxfp6_gemm": "``mxfp6``'s formats in three block-scaled GEMMs (codes in float8 "
                  "containers).",
    "mxfp4_gemm": "``mxfp4``'s formats in three block-scaled GEMMs (float4 codes).",
    "nvfp4_gemm": "NVIDIA's NVFP4 training recipe: 16x16 weight blocks, a random Hadamard "
                  "transform (size 16) on the weight-gradient inputs, errors rounded "
                  "stochastically; float4 codes, E4M3 block scales.",
}
"""One doc per built-in preset (what `PRESETS.__doc__`, ``--help`` and the docs list)."""

_PRESETS: Registry[QuantConfig] = Registry("quantizer preset")

PRESETS = _PRESETS.view(
    intro="""Quantizer recipes by name: a read-only view of the preset registry, always current.

`get_preset(name)` returns one, `register_preset(name, config, doc)` adds one (in any
module: a preset is one call), and the main job's ``--config.precision.quantizer``,
its validation and ``--help`` read this table. The presets registered now:""",
    outro="""The fixed-width formats (OCP, MX elements, NVFP4) ignore the width except
``bits >= 32`` (full precision); the papers' formats and MX("int"/"float") use it.
Weight formats block along axis -2, the input features of a Dense kernel
``(in, out)`` and of a conv kernel ``HWIO``; activations along -1 (features);
errors along -1 (the axis the input-gradient product contracts; see
docs/formats.md for the weight gradient).""")


def register_preset(name: str, config: QuantConfig, doc: str, *,
                    replace: bool = False) -> QuantConfig:
    """Register the quantizer recipe `config` as `name`: `get_preset`, `PRESETS` (and its
    docstring), the main job's ``--config.precision.quantizer`` and ``--help`` see it.

    Call it once, in the module that defines the recipe (a user's own module, imported by
    a script or a config file, is enough). The same name with an equal config and doc
    again is a no-op; another config needs ``replace=True``.

    Args:
      name: the preset's name, ``[a-z][a-z0-9_]*``.
      config: a `QuantConfig` (not a `FormatSwitch`: `cpt_jax.format_schedule` builds
        those from presets).
      doc: what the recipe is, one or two sentences (listed in ``PRESETS.__doc__``).
      replace: replace a preset already registered under `name`.

    Returns:
      `config`.

    Example:
      >>> halves = QuantConfig(weight=TensorQuant(SymmetricInt(channel_axis=-1)),
      ...                      activation=None, error=None)
      >>> _ = register_preset("weights_only", halves, "Symmetric weights, fp32 activations.")
      >>> get_preset("weights_only") is halves, "weights_only" in PRESETS
      (True, True)
      >>> unregister_preset("weights_only")
    """
    if not isinstance(config, QuantConfig) or isinstance(config, FormatSwitch):
        raise ValueError(f"register_preset({name!r}, config, ...): config must be a QuantConfig "
                         f"(a FormatSwitch is built by cpt_jax.format_schedule), got {config!r}")
    return _PRESETS.register(name, config, doc, replace=replace)


def unregister_preset(name: str) -> None:
    """Remove the preset `name` (tests, notebooks); ValueError naming the known ones."""
    _PRESETS.unregister(name)


def preset_doc(name: str) -> str:
    """The doc `name` was registered with.

    Example:
      >>> preset_doc("fp8_rowwise")
      'FP8 with one scale per row: amax over the contracted axis.'
    """
    return _PRESETS.doc(name)


def get_preset(name: str) -> QuantConfig:
    """The `QuantConfig` recipe registered as `name` (`PRESETS`, `register_preset`).

    Args:
      name: a key of `PRESETS` (e.g. ``"cpt"``, ``"fp8_tensor"``, ``"mxfp4"``).

    Returns:
      The frozen `QuantConfig`.

    Example:
      >>> get_preset("mxfp8").weight.fmt
      MX(element='e4m3', block_size=32, axis=-2)
      >>> get_preset("mxfp9")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: unknown quantizer preset 'mxfp9'; known: [...]
    """
    return _PRESETS.get(name)



CPT_CONFIG = BUILTIN_PRESETS["cpt"]
"""CPT's quantizer: affine min-max, weights per channel, errors stochastic."""

INT8_CONFIG = BUILTIN_PRESETS["int8"]
"""Symmetric integer operands that feed a real int8 x int8 -> int32 product."""


def operand_bits(config: QuantConfig | None, bits, grad_bits) -> tuple:
    """Stored bits per element ``(b_w, b_a, b_g)`` of an op under `config`, scales included.

    ``formats.bits_per_element`` of the weight and activation formats at the
    forward width and of the error format at `grad_bits`; a tensor kept in full
    precision (None, or `grad_bits` None) counts 32; ``config=None`` is
    ``(bits, bits, grad_bits)`` (the papers' accounting).

    Example:
      >>> [float(b) for b in operand_bits(get_preset("mxfp4"), 4, 4)]
      [4.25, 4.25, 4.25]
    """
    if config is None:
        g = 32.0 if grad_bits is None else grad_bits
        return bits, bits, g
    declared = COMPUTES.get(config.compute, ComputeSpec()).operand_bits
    if declared is not None:
        return declared(config, bits, grad_bits)
    if isinstance(config, FormatSwitch):
        per_format = [operand_bits(c, bits, grad_bits) for c in config.branches]
        index = format_index(config.widths, bits)
        return tuple(jnp.stack([jnp.asarray(b[j], jnp.float32) for b in per_format])[index]
                     for j in range(3))

    def count(tq, b):
        if tq is None or b is None:
            return 32.0
        return formats.bits_per_element(tq.fmt, b)

    return count(config.weight, bits), count(config.activation, bits), count(config.error, grad_bits)

FULL_PRECISION = "full_precision"
"""Rule target that keeps matching modules in full precision."""

# --------------------------------------------------------------------------- format switch

def format_index(widths: Sequence[float], bits):
    """Which of `widths` (increasing) a step at `bits` uses: the widest ``<= bits``.

    ``i = clip(#{w_j <= bits} - 1, 0, n - 1)``: below the narrowest width, the
    narrowest; traceable in `bits` (int32).

    Example:
      >>> [int(format_index((4.0, 6.0, 8.0), b)) for b in (3, 4, 5, 6, 7, 8, 32)]
      [0, 0, 0, 1, 1, 2, 2]
    """
    w = jnp.asarray(tuple(widths), jnp.float32)
    count = jnp.sum(w <= jnp.asarray(bits, jnp.float32))
    return jnp.clip(count - 1, 0, len(widths) - 1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class FormatSwitch(QuantConfig):
    """A config that picks one of several recipes per step (`cpt_jax.format_schedules`).

    A step at width ``b`` computes every product with ``branches[format_index(
    widths, b)]`` (``lax.switch``: every branch is in the one compiled step); the
    cost counts that branch's stored bits. Weight, activation and error are the
    widest branch's (what a tool reading one recipe sees).

    Attributes:
      names: the recipes' names (`PRESETS` keys), narrow to wide.
      branches: their configs (`QuantConfig`).
      widths: their element widths, strictly increasing.
    """

    names: tuple[str, ...] = ()
    branches: tuple[QuantConfig, ...] = ()
    widths: tuple[float, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if not self.branches or not (len(self.names) == len(self.branches) == len(self.widths)):
            raise ValueError(f"FormatSwitch needs as many names, branches and widths (>= 1), "
                             f"got {self.names!r}, {len(self.branches)}, {self.widths!r}")
        if any(b >= a for a, b in zip(self.widths[1:], self.widths[:-1])):
            raise ValueError(f"FormatSwitch.widths must increase (formats narrow to wide), "
                             f"got {dict(zip(self.names, self.widths))}")
        for name, branch in zip(self.names, self.branches):
            check_switch_branch(f"FormatSwitch format {name!r}", branch)

    def __repr__(self) -> str:
        return f"FormatSwitch(names={self.names!r}, widths={self.widths!r})"


def check_switch_branch(label: str, config) -> None:
    """Raise ValueError (starting with `label`, e.g. ``"formats[1]='int8'"``) unless
    `config` can be a branch of a `FormatSwitch`: a plain `QuantConfig` without int8,
    running ranges or delayed scaling (their state or products cannot change inside a
    ``lax.switch``).

    Example:
      >>> check_switch_branch("formats[1]='int8'", get_preset("int8"))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: formats[1]='int8' keeps state or an int8 product ...: it cannot be one of several formats ...step
    """
    if not isinstance(config, QuantConfig) or isinstance(config, FormatSwitch):
        raise ValueError(f"{label} must be a QuantConfig (not a FormatSwitch), got {config!r}")
    if config.compute == "int" or config.activation_range != "batch" or (
            config.gemm is not None and config.gemm.scaling == "delayed"):
        raise ValueError(f"{label} keeps state or an int8 product (compute='int', running activation "
                         "ranges or delayed scaling): it cannot be one of several formats "
                         "switched per step")


for _name, _config in BUILTIN_PRESETS.items():  # after FormatSwitch: register_preset checks it
    register_preset(_name, _config, BUILTIN_PRESET_DOCS[_name])
del _name, _config
