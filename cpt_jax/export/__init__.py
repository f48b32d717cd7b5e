"""Export: a low-precision-trained model as a real integer model in an int8 container.

A quantized product whose right operand is a weight (``nn.Dense``, ``nn.Conv``, ``x @
w`` or an einsum on a parameter, a tied ``attend``; one whose `quantize_model` rule
gives a `QuantConfig`) computes at ``b`` bits ``y = op(Q(x), Q(W)) + bias``, with ``op`` a
dot_general or a convolution and ``Q`` an integer grid. Every grid value is
``v = s c + z``: an integer code ``c`` that fits int8 for ``2 <= b <= 8``, a scale
``s`` and an offset ``z``:

==============  ================================================  =====================
grid            code ``c``                                        ``s``, ``z``
==============  ================================================  =====================
`AffineInt`     ``clip(round((x - lo)/s), 0, 2^b-1) - 2^(b-1)``   ``s = (hi-lo)/(2^b-1)``,
                                                                  ``z = lo + 2^(b-1) s``
`SymmetricInt`  ``clip(round(x/s), -L, L)``, ``L = 2^(b-1)-1``    ``s = max|x|/L``, ``z = 0``
==============  ================================================  =====================

(``s`` is at least 1e-8, as in `cpt_jax.formats`). Weights get one ``(s, z)`` per
output channel, from the weights themselves: the training's grid, code for code.
Activations get one static ``(s, z)`` per product from a range ``[lo, hi]``: the
run's running activation ranges (`running_ranges`, CPT's evaluation protocol,
``QuantConfig(activation_range="running")``) when it kept them, else `calibrate`
(min and max of the product's activation over training batches, through the
fake-quant model at ``b`` bits), since a deployed model cannot measure a range per
batch. The integer product of a bilinear ``op`` is then (`integer_product`)

    op(x_q, W_q) = s_x (s_w op(c_x, c_w) + z_w op(c_x, 1_W)) + z_x op(1_x, W_q)

``op(c_x, c_w)``: int8 x int8 accumulated in int32; ``op(c_x, 1_W)``: the sums of
the activation codes under each window (channels summed, then a box sum);
``op(1_x, W_q)``: the dequantized weights summed over each window's *valid* inputs
(one example, so zero padding stays exactly zero). XLA's CPU backend has no fast
int8 convolution: there a convolution runs on the same codes held in float32
(every partial sum an integer below 2^24 while ``kh kw C_in * 128^2 < 2^24``, so
equal to int32); dots are int8 everywhere. An ``nn.Embed`` lookup whose table is
quantized stores the table as int8 codes (one grid per row) and gathers dequantized
rows; an attention product (two activations) gets a static grid per operand and an
int8 einsum (`activation_product`).

Everything plugs into the interception seam (`cpt_jax.interception`): `calibrate`
runs the model with a `CalibrationProvider`, `fake_quant_apply` with a
`StaticRangeProvider` (the reference: CPT's fake quantization with the same static
activation grids, `cpt_jax.ops.grids.quantize_with_range`), `int8_apply` with an
`cpt_jax.providers.exported.ExportedModelProvider`, which computes every product whose
weight or activations have exported leaves (`cpt_jax.ops.integer`).

Kept in floating point: the products the rules keep in fp32 (the classifier by
default; ``export_model(..., fp32_layers="int8_weights")`` stores their weights as
int8 codes with float activations instead), biases, BatchNorm (kept, not folded:
folding it into the weights before quantization would change the codes the model
was trained on; its inference affine follows the rescale, and XLA fuses the two
into one elementwise pass), and every other op.

Example:
  >>> qmodel = cpt_jax.quantize_model(nn.Sequential([nn.Dense(3)]))
  >>> x = jax.random.normal(jax.random.key(0), (8, 4))
  >>> variables = qmodel.init(jax.random.key(1), x)
  >>> ranges = calibrate(qmodel, variables, [x], bits=8)
  >>> exported = export_model(qmodel, variables, 8, ranges, x)
  >>> exported.variables["params"]["layers_0"]["kernel"].dtype
  dtype('int8')
  >>> y_int8 = int8_apply(exported, x)
  >>> y_ref = fake_quant_apply(qmodel, variables, x, bits=8, ranges=ranges)
  >>> bool(jnp.allclose(y_int8, y_ref, atol=1e-5))
  True
"""
from cpt_jax.export._calibration import calibrate, running_ranges, with_provider
from cpt_jax.export._checks import (
    EXPORT_FORMAT_VERSION,
    FP32_LAYER_MODES,
    Ranges,
    check_export_bits,
    grid_kind,
    layer_bits,
)
from cpt_jax.export._model import ExportedModel, export_model, fake_quant_apply, int8_apply
from cpt_jax.export._storage import (
    from_numpy_dict,
    param_bytes,
    restore_exported,
    save_exported,
    to_numpy_dict,
)

__all__ = (
    "EXPORT_FORMAT_VERSION",
    "FP32_LAYER_MODES",
    "ExportedModel",
    "Ranges",
    "calibrate",
    "check_export_bits",
    "export_model",
    "fake_quant_apply",
    "from_numpy_dict",
    "grid_kind",
    "int8_apply",
    "layer_bits",
    "param_bytes",
    "restore_exported",
    "running_ranges",
    "save_exported",
    "to_numpy_dict",
    "with_provider",
)
