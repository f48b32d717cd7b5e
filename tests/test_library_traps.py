"""No silent traps in library use (issue 43, items 1, 2, 4, 5 and 8).

1. A `precision` context is part of JAX's jit-cache key while it is active: a function
   jitted outside a context and called inside one (or the reverse) is traced again,
   never reused with the other's widths; a concrete rng there is an error. An NNX
   submodule called directly is quantized. Widths below 1 bit never give NaN.
2. `make_train_step` calls a model without a ``train`` argument without one.
4. A preset name is accepted wherever a `QuantConfig` is.
5. A rule matching no product warns once per model (the CLI's error: test_bad_input).
8. One name per layer through Linen, NNX and the bridges; no repeated segments.
"""
from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import cpt_jax
from cpt_jax import context, formats
from cpt_jax.context import precision
from cpt_jax.doors import QuantDotGeneral, UnmatchedRuleWarning
from cpt_jax.training import create_train_state, make_eval_step, make_train_step

X = jax.random.normal(jax.random.key(0), (4, 6))


def _dense():
    qmodel = cpt_jax.quantize_model(nn.Dense(5))
    return qmodel, qmodel.init(jax.random.key(1), X)


def _apply_at(qmodel, v, x, bits):
    with precision(bits):
        return qmodel.apply(v, x)


def _reference(qmodel, v):
    """``ref(bits)``: the model at `bits` with the context inside the jitted function
    (the documented use; one compile for every width), ``ref(None)``: fp32."""
    at = jax.jit(functools.partial(_apply_at, qmodel))
    return lambda bits: np.asarray(qmodel.apply(v, X) if bits is None else at(v, X, bits))


# --------------------------------------------------------------------------- 1. stale precision

def test_a_function_traced_outside_a_context_is_traced_again_inside_one():
    qmodel, v = _dense()
    ref = _reference(qmodel, v)
    fp32, two = ref(None), ref(2.0)
    assert not np.allclose(fp32, two)
    f = jax.jit(lambda v, x: qmodel.apply(v, x))
    np.testing.assert_array_equal(f(v, X), fp32)
    with pytest.warns(context.StalePrecisionWarning, match="inside the jitted function"):
        with precision(2):
            np.testing.assert_allclose(f(v, X), two, atol=1e-6)
    np.testing.assert_array_equal(f(v, X), fp32)     # outside again: the fp32 trace


def test_a_function_traced_inside_a_context_is_traced_again_outside_and_per_width():
    qmodel, v = _dense()
    ref = _reference(qmodel, v)
    g = jax.jit(lambda v, x: qmodel.apply(v, x))
    with pytest.warns(context.StalePrecisionWarning):
        with precision(2):
            np.testing.assert_allclose(g(v, X), ref(2.0), atol=1e-6)
    np.testing.assert_array_equal(g(v, X), ref(None))
    with pytest.warns(context.StalePrecisionWarning):
        with precision(3):
            np.testing.assert_allclose(g(v, X), ref(3.0), atol=1e-6)


def test_a_jitted_function_called_inside_a_traced_context_is_not_its_eager_trace():
    qmodel, v = _dense()
    ref = _reference(qmodel, v)
    f = jax.jit(lambda v, x: qmodel.apply(v, x))
    f(v, X)                                              # cached outside any context

    @jax.jit
    def g(v, x, bits):
        with precision(bits):
            return f(v, x)

    np.testing.assert_allclose(g(v, X, 2.0), ref(2.0), atol=1e-6)
    np.testing.assert_array_equal(f(v, X), ref(None))


def test_a_concrete_rng_around_a_jitted_function_is_an_error_naming_the_fix():
    qmodel, v = _dense()
    f = jax.jit(lambda v, x: qmodel.apply(v, x))
    with pytest.raises(ValueError, match="inside the jitted function"):
        with precision(4, 8, rng=jax.random.key(0)):
            f(v, X)


def test_widths_traced_inside_the_step_compile_once_even_around_eager_contexts():
    qmodel, v = _dense()

    @jax.jit
    def step(v, x, bits):
        with precision(bits, grad_bits=8, rng=jax.random.key(0)):
            return jax.grad(lambda v: qmodel.apply(v, x).sum())(v)

    step(v, X, 2.0)
    with precision(4):                   # an eager context between two steps
        qmodel.apply(v, X)
    for bits in (3.0, 5.0, 8.0):
        step(v, X, bits)
    assert step._cache_size() == 1


def test_the_context_is_keyed_by_its_widths_not_by_the_values_in_a_trace():
    assert context.static_identity(None) is None
    state = context.PrecisionState(bits=jnp.float32(3), grad_bits=None, rng=jax.random.key(0))
    assert context.static_identity(state) == ("precision", 3.0, None, "rng")

    def traced(b):
        s = context.PrecisionState(bits=b, grad_bits=b)
        assert context.static_identity(s) == ("precision", "traced", "traced", None)
        return b

    jax.jit(traced)(1.0)


class _Enc(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(6, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.enc = _Enc(rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.enc(x))


@functools.partial(nnx.jit, static_argnames="part")
def _run(model, x, bits, part: str | None = None):
    with precision(bits):
        return (getattr(model, part) if part else model)(x)


def test_an_nnx_submodule_called_directly_is_quantized_under_the_models_rules():
    float_enc = nnx.clone(_Model(nnx.Rngs(0)).enc)
    qm = cpt_jax.quantize_model(_Model(nnx.Rngs(0)), rules=[("enc/l2", None)])
    alone = cpt_jax.quantize_model(float_enc, rules=[("l2", None)])   # the same weights
    direct = np.asarray(_run(qm, X, 2.0, "enc"))
    assert not np.allclose(direct, np.asarray(qm.enc(X)))             # not fp32
    np.testing.assert_allclose(direct, _run(alone, X, 2.0), atol=1e-6)
    layers = cpt_jax.quantized_layers(qm.enc, X)
    assert [(p.path, p.config is None) for p in layers] == [("enc/l1", False), ("enc/l2", True)]


def test_the_models_last_product_stays_fp32_when_its_submodule_is_called_directly():
    qm = cpt_jax.quantize_model(_Model(nnx.Rngs(0)), rules=cpt_jax.CPT_RULES)
    h = jnp.ones((4, 8))
    qm(X)                                   # the model's last product: head
    np.testing.assert_array_equal(_run(qm, h, 2.0, "head"), qm.head(h))


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(6, 6, rngs=rngs)

    def __call__(self, x):
        return x + nnx.tanh(self.proj(x))


def _stacked(make, n: int, rngs):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return make(rngs)

    return create(rngs)


class _Stack(nnx.Module):
    def __init__(self, rngs):
        self.blocks = _stacked(_Block, 3, rngs)

    def __call__(self, x):
        return _scan_blocks(self.blocks, x)


def _scan_blocks(blocks, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, h):
        return block(h)

    return body(blocks, x)


def test_a_scanned_submodule_called_directly_is_quantized_like_the_models_own_call():
    qm = cpt_jax.quantize_model(_Stack(nnx.Rngs(0)))

    @functools.partial(nnx.jit, static_argnames="direct")
    def run(qm, x, bits, direct: bool):
        with precision(bits):
            return _scan_blocks(qm.blocks, x) if direct else qm(x)

    direct, whole = (np.asarray(run(qm, X, 2.0, direct=d)) for d in (True, False))
    assert not np.allclose(direct, np.asarray(_scan_blocks(qm.blocks, X)))    # not fp32
    np.testing.assert_allclose(direct, whole, atol=1e-6)


def test_widths_below_one_bit_compute_at_one_bit_and_are_counted():
    q = jax.jit(lambda x, b: formats.quantize(x, b, formats.AffineInt()))
    for b in (0.0, 0.5):
        np.testing.assert_array_equal(q(X, b), q(X, 1.0))     # not NaN: one bit
    assert float(context.effective_bits(3.99, 0.0)) == 3.0    # 3.99 bits compute at 3
    assert float(context.effective_bits(-2.0, 0.0)) == 1.0
    model = cpt_jax.quantize_model(nn.Dense(3))
    state = create_train_state(model, optax.sgd(0.1), jax.random.key(0), X)
    step = make_train_step(model, optax.sgd(0.1), lambda t: jnp.where(t < 1, 0.0, 4.0),
                           donate=False)
    batch = {"inputs": X, "labels": jnp.zeros((4,), jnp.int32)}
    state, m0 = step(state, batch)
    _, m1 = step(state, batch)
    assert bool(m0["finite"]) and int(state.skipped_steps) == 0
    assert (float(m0["bits_clamped"]), float(m1["bits_clamped"])) == (1.0, 0.0)



# --------------------------------------------------------------------------- 2. train argument

class _QuickstartMLP(nn.Module):          # examples/quickstart.py's model: no `train`
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(3, name="classifier")(x)


class _WithTrain(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(3, name="classifier")(x)


@pytest.mark.parametrize("model,apply_kwargs", [(_QuickstartMLP(), {}), (_WithTrain(), None)],
                         ids=["no_train", "train"])
def test_make_train_step_calls_a_model_with_or_without_a_train_argument(model, apply_kwargs):
    qmodel = cpt_jax.quantize_model(model, rules=cpt_jax.CPT_RULES)
    state = create_train_state(qmodel, optax.sgd(0.1), jax.random.key(0), X)
    step = make_train_step(qmodel, optax.sgd(0.1), cpt_jax.constant(4), donate=False,
                           apply_kwargs=apply_kwargs)
    batch = {"inputs": X, "labels": jnp.zeros((4,), jnp.int32)}
    state, metrics = step(state, batch)
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
    sums = make_eval_step(qmodel, apply_kwargs=apply_kwargs)(state, batch, 4.0)
    assert float(sums["count"]) == 4.0


def test_the_train_argument_reaches_a_model_that_takes_it():
    qmodel = cpt_jax.quantize_model(_WithTrain())
    assert cpt_jax.training.call_kwargs(qmodel, {}, True) == {"train": True}
    assert cpt_jax.training.call_kwargs(_QuickstartMLP(), {}, True) == {}


def test_an_apply_kwarg_the_model_does_not_take_fails_when_the_step_is_built():
    qmodel = cpt_jax.quantize_model(_QuickstartMLP())
    with pytest.raises(ValueError, match=r"apply_kwargs \['train'\].*takes \['x'\]"):
        make_train_step(qmodel, optax.sgd(0.1), apply_kwargs={"train": True})


# --------------------------------------------------------------------------- 4. preset names

def test_a_preset_name_is_accepted_wherever_a_quant_config_is():
    mx, int8 = cpt_jax.get_preset("mxfp8"), cpt_jax.get_preset("int8")
    qmodel = cpt_jax.quantize_model(nn.Sequential([nn.Dense(4), nn.Dense(2)]), config="mxfp8",
                                    rules=[("layers_1", "int8")])
    v = qmodel.init(jax.random.key(1), X)
    assert [p.config for p in cpt_jax.quantized_layers(qmodel, v, X)] == [mx, int8]
    assert QuantDotGeneral(config="mxfp8").config == mx
    allocation = cpt_jax.allocation.Allocation("uniform", (("a", 1),), (1.0,), 1.0, 1.0)
    assert allocation.rules("int8")[0][1] == int8.replace(bits_offset=1.0)
    assert float(cpt_jax.cost.bitops_per_step(None, 8, 8, "mxfp8")) == float(
        cpt_jax.cost.bitops_per_step(None, 8, 8, mx))
    nnx_layer = cpt_jax.quantize_model(nnx.Linear(6, 5, rngs=nnx.Rngs(0)), config="int8")
    assert cpt_jax.doors.interception_of(nnx_layer).config == int8


@pytest.mark.parametrize("build", [
    lambda: cpt_jax.quantize_model(nn.Dense(5), config="mxfp9"),
    lambda: cpt_jax.quantize_model(nn.Dense(5), rules=[("Dense", "mxfp9")]),
    lambda: QuantDotGeneral(config="mxfp9"),
], ids=["config", "rule", "door"])
def test_an_unknown_preset_name_is_a_value_error_listing_the_known_ones(build):
    with pytest.raises(ValueError, match=r"unknown quantizer preset 'mxfp9'.*'mxfp8'"):
        build()


# --------------------------------------------------------------------------- 5. unmatched rules

def test_a_rule_matching_nothing_warns_once_per_model():
    qmodel = cpt_jax.quantize_model(nn.Sequential([nn.Dense(4), nn.Dense(2)]),
                                    rules=[("clasifier", None), *cpt_jax.CPT_RULES])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v = qmodel.init(jax.random.key(0), X)
        qmodel.apply(v, X)
        jax.jit(functools.partial(_apply_at, qmodel))(v, X, 4.0)
    unmatched = [w for w in caught if issubclass(w.category, UnmatchedRuleWarning)]
    assert len(unmatched) == 1, [str(w.message) for w in caught]
    assert "'clasifier'" in str(unmatched[0].message) and "layers_1" in str(unmatched[0].message)


# --------------------------------------------------------------------------- 8. names

@contextlib.contextmanager
def _appended_linen_path(name: str):
    """What MaxText's ``ToLinen`` does around each NNX submodule call: the current
    Linen module's scope path gets the submodule's name appended meanwhile."""
    stack = nn.module._context.module_stack
    module = stack[-1] if stack else None
    if module is None or module.scope is None:
        yield
        return
    old = module.scope.path
    module.scope.path = old + (name,)
    try:
        yield
    finally:
        module.scope.path = old


class _RawDense(nnx.Module):
    """A layer of its own (MaxText's ``DenseGeneral``): ``lax.dot_general`` inside."""

    def __init__(self, din, dout, rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))

    def __call__(self, x):
        return jax.lax.dot_general(x, self.kernel[...], (((x.ndim - 1,), (0,)), ((), ())))


class _Attention(nnx.Module):
    def __init__(self, rngs, wrapped: bool = False):
        self.query = nnx.LinearGeneral(6, (2, 3), rngs=rngs)
        self.key = _RawDense(6, 6, rngs)
        self.out = nnx.Linear(6, 6, rngs=rngs)
        self.wrapped = wrapped

    def _sub(self, name, x):
        scope = _appended_linen_path(name) if self.wrapped else contextlib.nullcontext()
        with scope:
            return getattr(self, name)(x)

    def __call__(self, x):
        q = self._sub("query", x).reshape(x.shape)
        scores = jnp.einsum("bd,cd->bc", q, self._sub("key", x))
        return self._sub("out", scores @ x)


class _NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = _Attention(rngs)
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.attn(x))


class _LinenBlock(nn.Module):
    wrapped: bool = False

    @nn.compact
    def __call__(self, x):
        y = nnx.bridge.ToLinen(_Attention, kwargs={"wrapped": self.wrapped}, name="attn")(x)
        return nn.Dense(3, name="head")(y)


EXPECTED = ["attn/query", "attn/key/dot_general_0", "attn/einsum_0", "attn/matmul_0",
            "attn/out", "head"]


def _linen_names(model):
    qmodel = cpt_jax.quantize_model(model)
    v = qmodel.init(jax.random.key(0), X)
    return [p.path for p in cpt_jax.quantized_layers(qmodel, v, X)]


def _no_repeated_segments(name: str) -> bool:
    parts = name.split("/")
    return all(parts[i:i + k] != parts[i + k:i + 2 * k]
               for k in range(1, len(parts) // 2 + 1) for i in range(len(parts) - 2 * k + 1))


def test_a_bridged_model_and_its_nnx_twin_name_every_product_alike():
    nnx_names = [p.path for p in cpt_jax.quantized_layers(
        cpt_jax.quantize_model(_NNXBlock(nnx.Rngs(0))), X)]
    assert nnx_names == EXPECTED
    assert _linen_names(_LinenBlock()) == EXPECTED
    assert _linen_names(_LinenBlock(wrapped=True)) == EXPECTED   # MaxText's ToLinen
    assert all(_no_repeated_segments(n) for n in EXPECTED)


class _LinenQuery(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral((2, 3), name="proj")(x)


class _NNXQuery(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.LinearGeneral(6, (2, 3), rngs=rngs)

    def __call__(self, x):
        return self.proj(x)


class _QueryOwner(nnx.Module):
    def __init__(self, query):
        self.query = query

    def __call__(self, x):
        return self.query(x)


def test_a_linen_layer_in_nnx_code_is_named_as_its_nnx_twin():
    class LinenOwner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return _LinenQuery(name="query")(x)

    bridged = _QueryOwner(nnx.bridge.ToNNX(_LinenQuery(), rngs=nnx.Rngs(0)))
    nnx.bridge.lazy_init(bridged, X)
    twin = _QueryOwner(_NNXQuery(nnx.Rngs(0)))
    names = [[p.path for p in cpt_jax.quantized_layers(cpt_jax.quantize_model(m), X)]
             for m in (bridged, twin)]
    assert names == [["query/proj"], ["query/proj"]]
    assert _linen_names(LinenOwner()) == ["query/proj"]


@pytest.mark.slow
def test_names_and_widths_under_shard_map_on_two_devices():
    """The product path under ``jax.shard_map`` on a 2-device mesh: the bridged model's
    names, a directly called NNX submodule, and a context around a shard-mapped jit."""
    code = textwrap.dedent("""
        import sys, warnings, jax, jax.numpy as jnp, numpy as np, flax.linen as nn
        from flax import nnx
        from jax.sharding import PartitionSpec as P
        sys.path.insert(0, "tests")
        import cpt_jax
        from test_library_traps import EXPECTED, X, _LinenBlock, _Model
        warnings.simplefilter("ignore")
        assert jax.device_count() == 2
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
        shard = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")),
                                        out_specs=P("data"))
        qmodel = cpt_jax.quantize_model(_LinenBlock(wrapped=True))
        v = qmodel.init(jax.random.key(0), X)
        ops = cpt_jax.cost.trace_ops(shard(lambda v, x: qmodel.apply(v, x)), v, X)
        assert [op.name for op in ops] == EXPECTED, [op.name for op in ops]
        def inside(v, x, b):
            with cpt_jax.precision(b):
                return shard(lambda v, x: qmodel.apply(v, x))(v, x)
        f = jax.jit(shard(lambda v, x: qmodel.apply(v, x)))
        fp32 = np.asarray(f(v, X))
        with cpt_jax.precision(2):
            two = np.asarray(f(v, X))
        assert not np.allclose(two, fp32)
        np.testing.assert_allclose(two, jax.jit(inside)(v, X, 2.0), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(f(v, X), fp32)
        qm = cpt_jax.quantize_model(_Model(nnx.Rngs(0)))
        alone = cpt_jax.quantize_model(nnx.clone(_Model(nnx.Rngs(0)).enc))
        def direct(module):
            graphdef, state = nnx.split(module)
            def run(state, x):
                with cpt_jax.precision(2):
                    return nnx.merge(graphdef, state)(x)
            return np.asarray(jax.jit(shard(run))(state, X))
        assert not np.allclose(direct(qm.enc), np.asarray(qm.enc(X)))
        np.testing.assert_allclose(direct(qm.enc), direct(alone), rtol=1e-5, atol=1e-5)
        print("RESULT ok")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT ok" in out.stdout


def test_bridged_names_under_nnx_scan_are_the_twins():
    """The same NNX attention scanned (``nnx.vmap`` layers run by ``nnx.scan``): every
    product named once, as in the unscanned twin, with no repeated segments."""
    class Scanned(nnx.Module):
        def __init__(self):
            self.layers = _stacked(_Attention, 2, nnx.Rngs(0))

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def body(layer, h):
                return layer(h)

            return body(self.layers, x)

    names = [p.path for p in cpt_jax.quantized_layers(cpt_jax.quantize_model(Scanned()), X)]
    assert names == [n.replace("attn", "layers") for n in EXPECTED[:-1]]
