"""The seam between cpt_jax and JAX (issue 29): patching all-or-nothing, one product
path for every kind, no effect on code that does not use cpt_jax, JAX internals in one
checked module."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import types
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import cpt_jax
from cpt_jax.interception import _jax_internals, _patching

KEY = jax.random.key(0)
X = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)), jnp.float32)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(5)(x)))


def _quantized_output():
    qmodel = cpt_jax.quantize_model(Net())
    variables = qmodel.init(KEY, X)
    with cpt_jax.precision(2):
        return variables, np.asarray(qmodel.apply(variables, X))


def _assert_jax_restored():
    for target in _jax_internals.TARGETS:
        fn = target.resolve()
        assert fn is None or not _patching.is_stub(fn), f"{target} left patched"
    assert not _patching.is_patched()
    np.testing.assert_allclose(jax.lax.dot_general(X, X.T, (((1,), (0,)), ((), ()))),
                               np.asarray(X) @ np.asarray(X).T, rtol=1e-5)


# --------------------------------------------------------------------------- all or nothing

INSTALLABLE = [t.name for t in _jax_internals.TARGETS if t.resolve() is not None]


@pytest.mark.parametrize("failing", range(len(INSTALLABLE)), ids=INSTALLABLE)
def test_a_failed_install_at_any_target_restores_every_one(failing, monkeypatch):
    _, expected = _quantized_output()
    install = _patching._install
    seen = []

    def flaky(target):
        if len(seen) == failing:
            raise RuntimeError(f"injected failure at {target.name}")
        seen.append(target.name)
        return install(target)

    monkeypatch.setattr(_patching, "_install", flaky)
    qmodel = cpt_jax.quantize_model(Net())
    with pytest.raises(RuntimeError, match="injected failure"):
        with cpt_jax.precision(2):
            qmodel.apply(Net().init(KEY, X), X)
    _assert_jax_restored()
    monkeypatch.setattr(_patching, "_install", install)
    np.testing.assert_array_equal(_quantized_output()[1], expected)   # the next session works


def test_a_failure_in_the_middle_of_one_patch_leaves_that_function_intact(monkeypatch):
    _, expected = _quantized_output()
    stub = _patching._stub_code
    calls = []

    def flaky(name, fn_name):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("injected failure while building a stub")
        return stub(name, fn_name)

    monkeypatch.setattr(_patching, "_stub_code", flaky)
    _patching._STUBS.clear()                       # force the stubs to be built again
    with pytest.raises(RuntimeError, match="injected failure"):
        _quantized_output()
    _assert_jax_restored()
    monkeypatch.setattr(_patching, "_stub_code", stub)
    np.testing.assert_array_equal(_quantized_output()[1], expected)


def test_installing_over_a_stub_is_refused():
    with _patching.patched(_jax_internals.TARGETS):
        with pytest.raises(_patching.PatchError, match="already a cpt_jax stub"):
            _patching._install_all(_jax_internals.TARGETS[:1])
    _assert_jax_restored()


# --------------------------------------------------------------------------- one product path

def _own_vjp(fn):
    """A user's custom_vjp around `fn` (its backward rule is the user's)."""
    rule = jax.custom_vjp(lambda *args: fn(*args))
    rule.defvjp(lambda *args: (fn(*args), args),
                lambda res, g: tuple(jnp.zeros_like(a) for a in res))
    return rule


KINDS = {
    "dot_general": (lambda x, w: x @ w, (4, 6), (6, 3)),
    "conv": (lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC")),
             (1, 4, 4, 2), (3, 3, 2, 3)),
    "conv_local": (lambda x, w: lax.conv_general_dilated_local(
        x, w, (1, 1), "VALID", (2, 2), dimension_numbers=("NHWC", "OIHW", "NHWC")),
        (1, 3, 3, 2), (3, 2 * 2 * 2, 2, 2)),
    "ragged_dot": (lambda x, w: lax.ragged_dot(x, w, jnp.array([2, 2], jnp.int32)),
                   (4, 6), (2, 6, 3)),
}


class OwnEmbed(nn.Embed):
    """An Embed whose lookup runs inside the user's custom_vjp."""

    def __call__(self, inputs):
        return _own_vjp(lambda table, ix: jnp.take(table, ix, axis=0))(self.embedding, inputs)


class InsideOwnVJP(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x):
        if self.kind == "lookup":
            return OwnEmbed(5, 3, name="embed")(jnp.argmax(x, axis=-1))
        fn, _, w_shape = KINDS[self.kind]
        w = self.param("w", nn.initializers.normal(1.0), w_shape)
        return _own_vjp(fn)(x, w)


@pytest.mark.parametrize("kind", [*sorted(KINDS), "lookup"])
def test_every_kind_inside_a_users_custom_vjp_warns_and_stays_fp32(kind):
    x_shape = KINDS[kind][1] if kind in KINDS else (4, 6)
    x = jnp.asarray(np.random.default_rng(1).normal(size=x_shape), jnp.float32)
    model = InsideOwnVJP(kind)
    qmodel = cpt_jax.quantize_model(model)
    with pytest.warns(UserWarning, match="inside a custom_vjp"):
        variables = qmodel.init(KEY, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cpt_jax.precision(2):
            y = qmodel.apply(variables, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(model.apply(variables, x)))
    assert [op.quantized for op in cpt_jax.count_ops(qmodel, variables, x)] == [False]


# --------------------------------------------------------------------------- no side effects

def test_a_thread_without_a_quantized_model_computes_with_jax_while_another_runs_one():
    """Thread B (plain JAX) runs while thread A holds a quantized session open: B's
    results and programs are JAX's own, and B's jitted function is not retraced."""
    f = jax.jit(lambda x, w: jnp.tanh(x @ w) @ w.T)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(6, 6)), jnp.float32)
    reference, jaxpr = np.asarray(f(X, w)), str(jax.make_jaxpr(lambda x, w: x @ w)(X, w))
    inside, release = threading.Event(), threading.Event()
    qmodel = cpt_jax.quantize_model(Net())
    variables = qmodel.init(KEY, X)
    traced = []

    class Holding(nn.Module):                       # keeps the session open mid-trace
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(3)(x)
            inside.set()
            release.wait(60)
            return y

    def thread_a():
        q = cpt_jax.quantize_model(Holding())
        v = q.init(KEY, X)
        inside.clear()
        with cpt_jax.precision(4):
            traced.append(q.apply(v, X))

    a = threading.Thread(target=thread_a)
    a.start()
    try:
        assert inside.wait(60)
        assert _patching.is_patched()               # the targets are taken over now
        assert f._cache_size() == 1
        np.testing.assert_array_equal(np.asarray(f(X, w)), reference)
        assert f._cache_size() == 1                 # a cache hit: nothing retraced
        assert str(jax.make_jaxpr(lambda x, w: x @ w)(X, w)) == jaxpr
        np.testing.assert_array_equal(np.asarray(Net().apply(variables, X)),
                                      np.asarray(qmodel.apply(variables, X)))
    finally:
        release.set()
        a.join(60)
    assert traced and not _patching.is_patched()


def test_importing_cpt_jax_changes_no_jit_cache_key_and_no_config():
    # Flax is imported first: on jax 0.12 importing flax itself changes the cache key.
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, flax.linen, flax.nnx, optax
        f = jax.jit(lambda x: x * 2)
        f(jnp.ones(3))
        before = {k: repr(v) for k, v in jax.config.values.items()}
        holders = len(getattr(jax.config, "_value_holders", {}))
        import cpt_jax
        import flax.linen as nn
        f(jnp.ones(3))
        after = {k: repr(v) for k, v in jax.config.values.items()}
        assert f._cache_size() == 1, f._cache_size()
        assert before == after, set(before.items()) ^ set(after.items())
        assert len(getattr(jax.config, "_value_holders", {})) == holders
        # The first quantized call creates cpt_jax's jit context (a user context whose
        # value is set only inside a quantized call): a function jitted before it is
        # traced once more, then hits its cache again; no JAX config changes.
        q = cpt_jax.quantize_model(nn.Dense(2))
        v = q.init(jax.random.key(0), jnp.ones((1, 3)))
        with cpt_jax.precision(4):
            q.apply(v, jnp.ones((1, 3)))
        f(jnp.ones(3))
        size = f._cache_size()
        assert size <= 2, size
        with cpt_jax.precision(4):
            q.apply(v, jnp.ones((1, 3)))
        assert float(f(jnp.ones(3))[0]) == 2.0 and f._cache_size() == size
        assert {k: repr(v) for k, v in jax.config.values.items()} == before
        print("OK")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


# --------------------------------------------------------------------------- JAX internals

def test_every_jax_internal_cpt_jax_reads_is_where_it_expects():
    assert _jax_internals.check() == [], f"jax {jax.__version__}: {_jax_internals.check()}"


def test_every_target_is_reached_from_a_public_module():
    for target in _jax_internals.TARGETS:
        assert not target.module.startswith(("jax._src", "flax.")) or target.module.startswith(
            ("flax.linen", "flax.nnx")), target
        if target.name not in _jax_internals.OPTIONAL_TARGETS:
            assert target.resolve() is not None, f"{target} missing in jax {jax.__version__}"


def test_check_names_the_jax_version_when_something_moved(monkeypatch):
    monkeypatch.setattr(_jax_internals, "TARGETS", (
        *_jax_internals.TARGETS, _jax_internals.Target("gone", "jax.lax", "no_such_function")))
    problems = _jax_internals.check()
    assert problems and all(jax.__version__ in p for p in problems), problems


# --------------------------------------------------------------------------- wrong calls

def test_quantized_layers_without_the_variables_names_the_signature():
    qmodel = cpt_jax.quantize_model(Net())
    with pytest.raises(ValueError, match=r"quantized_layers\(linen_model, variables"):
        cpt_jax.quantized_layers(qmodel, X)
    with pytest.raises(ValueError, match=r"count_ops\(linen_model, variables"):
        cpt_jax.count_ops(qmodel, X)


class Dropped(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(6, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, *, rngs=None):
        return self.dropout(self.linear(x), rngs=rngs)


def test_count_ops_of_nnx_in_train_mode_with_rngs_keyword():
    qmodel = cpt_jax.quantize_model(Dropped(nnx.Rngs(0)))
    qmodel.train()
    ops = cpt_jax.count_ops(qmodel, X, rngs=nnx.Rngs(dropout=0))
    assert [op.name for op in ops] == ["linear"]
    assert cpt_jax.cost.total_macs(ops) == 4 * 6 * 4
    assert isinstance(qmodel(X, rngs=nnx.Rngs(dropout=1)), jax.Array)   # still callable


def test_is_stub_tells_a_stub_from_a_function():
    with _patching.patched(_jax_internals.TARGETS):
        assert _patching.is_stub(jax.lax.dot_general)
    assert not _patching.is_stub(jax.lax.dot_general)
    assert not _patching.is_stub(types.SimpleNamespace())
