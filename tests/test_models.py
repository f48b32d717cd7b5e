"""Tests for cpt_jax.models: ResNets, small models, norms and the registry."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpt_jax.models import (
    MLP,
    MODEL_NAMES,
    CifarResNet,
    EvoNormS0,
    RangeEvoNorm,
    ResNet18,
    SmallCNN,
    get_model,
    make_norm,
    range_chunks,
    range_constant,
)

# A counter-based key that compiles much faster on CPU than threefry (tests only).
KEY = jax.random.key(0, impl="unsafe_rbg")


def _init(model: nn.Module, x: jax.Array) -> dict:
    return jax.jit(model.init)(KEY, x)


def _randn(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _num_params(model: nn.Module, shape: tuple[int, ...]) -> int:
    variables = jax.eval_shape(model.init, KEY, jnp.zeros(shape))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables["params"]))


# ---------------------------------------------------------------- architecture ---

def expected_cifar_resnet_params(depth: int, num_classes: int = 10, w: int = 16) -> int:
    """Parameter count of a CIFAR ResNet-(6n+2) with conv+BN projection shortcuts,
    from the architecture: convs without bias, BN has gamma and beta."""
    n = (depth - 2) // 6
    total = 3 * 3 * 3 * w + 2 * w  # stem conv + BN
    c_in = w
    for c in (w, 2 * w, 4 * w):
        for _ in range(n):
            total += 9 * c_in * c + 2 * c + 9 * c * c + 2 * c
            if c_in != c:
                total += c_in * c + 2 * c  # 1x1 shortcut conv + BN
            c_in = c
    return total + c_in * num_classes + num_classes


@pytest.mark.parametrize("depth", [20, 38, 74, 110])
def test_cifar_resnet_param_counts(depth):
    model = CifarResNet(depth=depth, num_classes=10)
    assert _num_params(model, (1, 32, 32, 3)) == expected_cifar_resnet_params(depth)


def test_param_counts_match_published_figures():
    # He et al. 2016, Table 6: ResNet-20 0.27M, ResNet-110 1.7M (option A shortcuts;
    # the conv shortcuts add ~3k and ~30k).
    assert abs(_num_params(CifarResNet(depth=20), (1, 32, 32, 3)) - 0.27e6) < 0.01e6
    assert abs(_num_params(CifarResNet(depth=110), (1, 32, 32, 3)) - 1.7e6) < 0.05e6
    # torchvision resnet18 (1000 classes) has 11,689,512 parameters.
    assert _num_params(ResNet18(num_classes=1000), (1, 64, 64, 3)) == 11_689_512


@pytest.mark.parametrize("model, shape, classes", [
    (CifarResNet(depth=8, num_classes=7), (2, 8, 8, 3), 7),
    (CifarResNet(depth=110, num_classes=100), (2, 32, 32, 3), 100),
    (ResNet18(num_classes=5, width=8), (2, 32, 32, 3), 5),
    (ResNet18(num_classes=1000), (1, 224, 224, 3), 1000),
    (MLP(hidden=(16, 8), num_classes=10), (2, 8, 8, 1), 10),
    (SmallCNN(features=(4, 8), num_classes=10), (2, 8, 8, 1), 10),
    (SmallCNN(features=(4, 8), num_classes=3), (2, 28, 28, 1), 3),
])
def test_output_shapes(model, shape, classes):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    variables = jax.eval_shape(model.init, KEY, x)
    y, _ = jax.eval_shape(
        lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]), variables, x)
    assert y.shape == (shape[0], classes)
    y = jax.eval_shape(lambda v, x: model.apply(v, x, train=False), variables, x)
    assert y.shape == (shape[0], classes)


def test_forward_runs_on_mnist_shape():
    model = SmallCNN(features=(4, 8), num_classes=3)
    x = _randn((2, 28, 28, 1), 1)
    variables = _init(model, x)
    y, _ = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))(
        variables, x)
    assert np.all(np.isfinite(y)) and float(jnp.std(y)) > 0


def test_stage_shapes_and_names():
    model = CifarResNet(depth=14, width=4)
    x = jax.ShapeDtypeStruct((1, 16, 16, 3), jnp.float32)
    variables = jax.eval_shape(model.init, KEY, x)
    params = variables["params"]
    assert set(params) == {"stem_conv", "stem_norm", "classifier",
                           *(f"stage{s}_block{b}" for s in (1, 2, 3) for b in (1, 2))}
    # widths 4/8/16, projection shortcuts only where the shape changes
    assert params["stage1_block1"]["conv2"]["kernel"].shape == (3, 3, 4, 4)
    assert "shortcut_conv" not in params["stage1_block1"]
    assert params["stage2_block1"]["shortcut_conv"]["kernel"].shape == (1, 1, 4, 8)
    assert params["stage3_block1"]["shortcut_conv"]["kernel"].shape == (1, 1, 8, 16)
    assert "shortcut_conv" not in params["stage3_block2"]
    assert params["classifier"]["kernel"].shape == (16, 10)
    # spatial: 16 -> 16 -> 8 -> 4
    _, state = jax.eval_shape(lambda v, x: model.apply(
        v, x, capture_intermediates=True, mutable=["intermediates"]), variables, x)
    inter = state["intermediates"]
    assert inter["stage2_block1"]["__call__"][0].shape == (1, 8, 8, 8)
    assert inter["stage3_block2"]["__call__"][0].shape == (1, 4, 4, 16)
    r18 = jax.eval_shape(ResNet18(num_classes=4, width=4).init, KEY,
                         jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32))["params"]
    assert r18["stem_conv"]["kernel"].shape == (7, 7, 3, 4)
    assert "shortcut_conv" in r18["stage2_block1"] and "shortcut_conv" not in r18["stage1_block1"]


def test_conv_init_is_kaiming_fan_out():
    from cpt_jax.models import BasicBlock

    block = BasicBlock(features=64, strides=1, norm=make_norm("batch"))
    params = _init(block, jnp.ones((1, 2, 2, 64)))["params"]
    k = np.asarray(params["conv2"]["kernel"])  # 3x3, 64 -> 64
    assert abs(k.std() - math.sqrt(2.0 / (9 * 64))) < 0.05 * math.sqrt(2.0 / (9 * 64))
    assert abs(k.mean()) < 0.01


@pytest.mark.parametrize("bad", [21, 7, 2, 0, -4, 20.0])
def test_depth_validation(bad):
    with pytest.raises(ValueError, match="depth"):
        CifarResNet(depth=bad)


def test_bad_norm_name():
    with pytest.raises(ValueError, match="norm"):
        CifarResNet(depth=20, norm="layer")
    with pytest.raises(ValueError, match="hard_sigmoid"):
        make_norm("batch", hard_sigmoid=True)


# ------------------------------------------------------------------ batch norm ---

def test_batchnorm_stats_update_in_train_not_eval():
    model = CifarResNet(depth=8, width=8)
    x = _randn((4, 8, 8, 3)) + 1.0
    variables = _init(model, x)
    old = variables["batch_stats"]
    apply = jax.jit(model.apply, static_argnames=("train", "mutable"))
    _, upd = apply(variables, x, train=True, mutable=("batch_stats",))
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), old, upd["batch_stats"])
    assert all(jax.tree.leaves(changed))
    _, upd_eval = apply(variables, x, train=False, mutable=("batch_stats",))
    same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), old, upd_eval["batch_stats"])
    assert all(jax.tree.leaves(same))


def test_batchnorm_momentum_and_eps_as_pytorch():
    layer = make_norm("batch")(train=True)
    assert layer.momentum == 0.9 and layer.epsilon == 1e-5
    x = _randn((16, 3)) * 2.0 + 3.0
    variables = layer.init(KEY, x)
    _, upd = layer.apply(variables, x, mutable=["batch_stats"])
    xn = np.asarray(x)
    np.testing.assert_allclose(upd["batch_stats"]["mean"], 0.1 * xn.mean(0), rtol=1e-5)
    np.testing.assert_allclose(upd["batch_stats"]["var"], 0.9 + 0.1 * xn.var(0), rtol=1e-5)


# ----------------------------------------------------------------------- norms ---

def _np_gate(z: np.ndarray, hard: bool) -> np.ndarray:
    return np.clip(z / 6.0 + 0.5, 0.0, 1.0) if hard else 1.0 / (1.0 + np.exp(-z))


def np_evonorm_s0(x, gamma, beta, v, groups=8, eps=1e-5, hard=False):
    """Reference in NCHW, as the authors' PyTorch EvoNormSample2d."""
    x = np.transpose(np.asarray(x, np.float64), (0, 3, 1, 2))
    b, c, h, w = x.shape
    num = x * _np_gate(x * v[None, :, None, None], hard)
    var = x.reshape(b, groups, -1).var(axis=-1, keepdims=True)
    y = (num.reshape(b, groups, -1) / np.sqrt(var + eps)).reshape(b, c, h, w)
    y = y * gamma[None, :, None, None] + beta[None, :, None, None]
    return np.transpose(y, (0, 2, 3, 1))


def np_range_evonorm(x, gamma, beta, v, groups=8, chunks=16, eps=1e-5, hard=False):
    """Reference in NCHW: the group (C/G, H, W) flattened and cut into chunks."""
    x = np.transpose(np.asarray(x, np.float64), (0, 3, 1, 2))
    b, c, h, w = x.shape
    y = x.reshape(b, groups, chunks, -1)
    m = y.shape[-1]
    r = y.max(-1).mean(-1) - y.min(-1).mean(-1)  # (B, G)
    c_m = 0.5 * 0.35 * (1 + np.sqrt(np.pi * np.log(4.0))) / np.sqrt(2 * np.log(m))
    num = x * _np_gate(x * v[None, :, None, None], hard)
    out = num.reshape(b, groups, -1) / (r * c_m + eps)[..., None]
    out = out.reshape(b, c, h, w) * gamma[None, :, None, None] + beta[None, :, None, None]
    return np.transpose(out, (0, 2, 3, 1))


def _random_norm_params(c: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"scale": rng.normal(1.0, 0.3, c).astype(np.float32),
            "bias": rng.normal(0.0, 0.3, c).astype(np.float32),
            "v": rng.normal(1.0, 0.3, c).astype(np.float32)}


@pytest.mark.parametrize("hard", [False, True])
def test_evonorm_s0_matches_numpy(hard):
    x = _randn((3, 5, 4, 16)) * 2.0 + 0.5
    p = _random_norm_params(16)
    layer = EvoNormS0(groups=4, hard_sigmoid=hard)
    y = layer.apply({"params": p}, x)
    ref = np_evonorm_s0(x, p["scale"], p["bias"], p["v"], groups=4, hard=hard)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hard", [False, True])
def test_range_evonorm_matches_numpy(hard):
    x = _randn((2, 8, 8, 16)) * 1.5  # n per group = 2*64 = 128, m = 8
    p = _random_norm_params(16, seed=2)
    y = RangeEvoNorm(hard_sigmoid=hard).apply({"params": p}, x)
    ref = np_range_evonorm(x, p["scale"], p["bias"], p["v"], hard=hard)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5)


def test_range_evonorm_non_divisible_chunks():
    # C = 8, groups = 8: n = 3*3 = 9 elements per group, 16 does not divide 9:
    # 3 chunks of 3 are used.
    assert range_chunks(9, 16) == (3, 3)
    assert range_chunks(2048, 16) == (16, 128)
    assert range_chunks(24, 16) == (12, 2)
    assert range_chunks(2, 16) == (1, 2)
    with pytest.raises(ValueError):
        range_chunks(1, 16)
    x = _randn((2, 3, 3, 8))
    p = _random_norm_params(8, seed=3)
    y = RangeEvoNorm().apply({"params": p}, x)
    ref = np_range_evonorm(x, p["scale"], p["bias"], p["v"], chunks=3)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5)


def test_range_constant():
    # 0.5 * 0.35 * (1 + sqrt(pi ln 4)) = 0.540209..., sqrt(2 ln 128) = 3.115143...
    assert range_constant(128) == pytest.approx(0.540209 / 3.115143, rel=1e-5)
    assert range_constant(2) == pytest.approx(0.540209 / 1.177410, rel=1e-5)
    with pytest.raises(ValueError, match="m"):
        range_constant(1)


def test_range_estimate_approximates_std():
    # For Gaussian data r * C(m) should be close to the std (the point of C(m)).
    x = 3.0 * _randn((1, 32, 32, 8))
    p = {"scale": np.ones(8, np.float32), "bias": np.zeros(8, np.float32),
         "v": np.full(8, 1e-9, np.float32)}  # gate = sigmoid(~0) = 0.5
    y = RangeEvoNorm(eps=0.0).apply({"params": p}, x)
    ratio = np.asarray(0.5 * x / y)  # = r * C(m), per group
    assert 2.4 < np.median(ratio) < 3.6


def test_hard_sigmoid_differs_and_is_piecewise_linear():
    x = jnp.linspace(-8, 8, 16 * 4).reshape(1, 2, 2, 16)
    p = _random_norm_params(16)
    p["v"] = np.ones(16, np.float32)
    for cls in (EvoNormS0, RangeEvoNorm):
        soft = cls().apply({"params": p}, x)
        hard = cls(hard_sigmoid=True).apply({"params": p}, x)
        assert not np.allclose(soft, hard)
        # where v x <= -3 the hard gate is exactly 0: output = beta
        mask = np.asarray(x <= -3.0)
        np.testing.assert_allclose(np.asarray(hard)[mask],
                                   np.broadcast_to(p["bias"], x.shape)[mask], atol=1e-6)


def test_evonorms_are_stateless_and_replace_batchnorm():
    x = _randn((2, 4, 4, 16))
    for name in ("evonorm", "range_evonorm"):
        layer = make_norm(name)(train=True)
        variables = layer.init(KEY, x)
        assert set(variables) == {"params"}
        y1 = layer.apply(variables, x)
        y2 = layer.apply(variables, x, use_running_average=True)
        np.testing.assert_array_equal(y1, y2)
        # per example: the output for one example does not depend on the others
        np.testing.assert_allclose(layer.apply(variables, x[:1]), y1[:1], rtol=1e-5)
    with pytest.raises(ValueError, match="groups"):
        EvoNormS0(groups=3).init(KEY, x)


def _xent_loss(model: nn.Module, x: jax.Array, labels: jax.Array):
    def loss_fn(params):
        logits = model.apply({"params": params}, x, train=True)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                             labels[:, None], axis=1))
    return loss_fn


@pytest.mark.slow
def test_resnet_with_evonorms_forward_backward():
    x = _randn((2, 8, 8, 3), 1)
    labels = jnp.array([1, 3])
    # the three EvoNorm variants have the same parameters: initialise once
    variables = _init(CifarResNet(depth=8, norm="range_evonorm"), x)
    assert set(variables) == {"params"}  # stateless: no batch_stats
    assert set(variables["params"]["stem_norm"]) == {"scale", "bias", "v"}
    for norm in ("range_evonorm", make_norm("range_evonorm", hard_sigmoid=True)):
        model = CifarResNet(depth=8, norm=norm)
        loss, grads = jax.jit(jax.value_and_grad(_xent_loss(model, x, labels)))(
            variables["params"])
        assert np.isfinite(loss)
        leaves = jax.tree.leaves(grads)
        assert all(np.all(np.isfinite(g)) for g in leaves)
        assert all(float(jnp.abs(g).max()) > 0 for g in leaves), norm


@pytest.mark.parametrize("norm", ["evonorm", "none"])
def test_resnet_other_norms_trace_forward_backward(norm):
    model = CifarResNet(depth=8, norm=norm)
    x = jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32)
    variables = jax.eval_shape(model.init, KEY, x)
    assert set(variables) == {"params"}
    # convs get a bias only without a norm
    assert ("bias" in variables["params"]["stem_conv"]) == (norm == "none")
    grads = jax.eval_shape(
        lambda p, x: jax.grad(_xent_loss(model, x, jnp.array([0, 1])))(p),
        variables["params"], x)
    assert jax.tree.structure(grads) == jax.tree.structure(variables["params"])


# ------------------------------------------------------------- interceptable ---

def _count_primitives(jaxpr, names: tuple[str, ...]) -> dict[str, int]:
    counts = {n: 0 for n in names}

    def visit(j):
        for eqn in j.eqns:
            if eqn.primitive.name in counts:
                counts[eqn.primitive.name] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr.jaxpr)
    return counts


def test_every_conv_and_matmul_is_an_intercepted_module():
    depth, n = 20, 3
    # stem + 2 convs per block + a 1x1 projection at the first block of stages 2, 3
    expected_convs = 1 + 2 * 3 * n + 2
    assert expected_convs == 21
    model = CifarResNet(depth=depth)
    x = jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32)
    variables = jax.eval_shape(model.init, KEY, x)
    calls = {"Conv": [], "Dense": []}

    def interceptor(next_fun, args, kwargs, context):
        name = type(context.module).__name__
        if name in calls and context.method_name == "__call__":
            calls[name].append("/".join(context.module.scope.path))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):  # interception happens at trace time
        jax.eval_shape(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]),
                       variables, x)
    assert len(calls["Conv"]) == expected_convs
    assert sum("shortcut_conv" in p for p in calls["Conv"]) == 2
    assert calls["Dense"] == ["classifier"]
    # ...and those modules are the only convs / matmuls in the computation.
    jaxpr = jax.make_jaxpr(
        lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))(variables, x)
    counts = _count_primitives(jaxpr, ("conv_general_dilated", "dot_general"))
    assert counts == {"conv_general_dilated": expected_convs, "dot_general": 1}


def test_intercepting_convs_changes_output():
    # the transform's mechanism: replacing nn.Conv outputs must affect the logits
    model = SmallCNN(features=(4, 8))
    x = _randn((2, 8, 8, 1), 1)
    variables = _init(model, x)

    def zero_convs(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        return out * 0.0 if isinstance(context.module, nn.Conv) else out

    with nn.intercept_methods(zero_convs):
        y = model.apply(variables, x)
    bias = variables["params"]["classifier"]["bias"]
    np.testing.assert_allclose(y, np.broadcast_to(bias, y.shape), atol=1e-6)


# ---------------------------------------------------------------- small models ---

def test_mlp_dropout_uses_dropout_rng():
    model = MLP(hidden=(32,), num_classes=4, dropout_rate=0.5)
    x = jnp.ones((3, 8))
    variables = model.init(KEY, x)
    y_eval = model.apply(variables, x)
    k1, k2 = jax.random.split(KEY)
    y1 = model.apply(variables, x, train=True, rngs={"dropout": k1})
    y2 = model.apply(variables, x, train=True, rngs={"dropout": k2})
    assert not np.allclose(y1, y2) and not np.allclose(y1, y_eval)
    np.testing.assert_array_equal(y_eval, model.apply(variables, x))


@pytest.mark.slow
def test_small_cnn_learns_digits():
    import optax
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    x_tr, y_tr, x_te, y_te = x[:1400], y[:1400], x[1400:], y[1400:]

    model = get_model("cnn", num_classes=10, features=(16, 32))
    variables = _init(model, x_tr[:2])
    tx = optax.adam(3e-3)
    opt_state = tx.init(variables["params"])

    @jax.jit
    def step(params, stats, opt_state, xb, yb):
        def loss_fn(p):
            logits, upd = model.apply({"params": p, "batch_stats": stats}, xb, train=True,
                                      mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
            return loss, upd["batch_stats"]
        (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    params, stats = variables["params"], variables["batch_stats"]
    for epoch in range(4):
        order = np.random.default_rng(epoch).permutation(len(x_tr))
        for i in range(0, len(x_tr) - 63, 64):
            idx = order[i:i + 64]
            params, stats, opt_state = step(params, stats, opt_state, x_tr[idx], y_tr[idx])
    logits = model.apply({"params": params, "batch_stats": stats}, x_te, train=False)
    acc = float(np.mean(np.argmax(logits, -1) == y_te))
    assert acc > 0.95, acc


# -------------------------------------------------------------------- registry ---

def test_registry_builds_models():
    assert isinstance(get_model("mlp", num_classes=3), MLP)
    assert isinstance(get_model("cnn", num_classes=3), SmallCNN)
    for d in (20, 38, 74, 110):
        m = get_model(f"resnet{d}", num_classes=100, norm="evonorm")
        assert isinstance(m, CifarResNet) and m.depth == d and m.num_classes == 100
    assert get_model("resnet", depth=56, num_classes=10).depth == 56
    assert isinstance(get_model("resnet18", num_classes=1000), ResNet18)
    with pytest.raises(ValueError, match="depth"):
        get_model("resnet", num_classes=10)
    with pytest.raises(ValueError, match="depth"):
        get_model("resnet", depth=21, num_classes=10)


def test_registry_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        get_model("resnet21", num_classes=10)
    for name in ("mlp", "cnn", "resnet20", "resnet110", "resnet18", "gcn",
                 "transformer_lm"):
        assert name in str(info.value)
    assert set(MODEL_NAMES) >= {"mlp", "cnn", "resnet20", "resnet38", "resnet74",
                                "resnet110", "resnet", "resnet18", "gcn", "lstm_lm",
                                "transformer_lm", "transformer_classifier"}


def test_registry_lazy_models(monkeypatch):
    import cpt_jax.models as models

    # Both lazily imported models ship with the package: no condition, they must load.
    assert type(get_model("gcn", num_classes=7)).__name__ == "GCN"
    assert get_model("gcn", num_classes=7).num_classes == 7
    lm = get_model("lstm_lm", num_classes=50)
    assert type(lm).__name__ == "LSTMLanguageModel" and lm.vocab_size == 50
    # a lazily registered module that does not exist gives a clear ValueError
    monkeypatch.setitem(models._LAZY, "gcn", ("cpt_jax.models.no_such_module", "GCN"))
    with pytest.raises(ValueError, match="gcn.*no_such_module"):
        get_model("gcn", num_classes=7)
