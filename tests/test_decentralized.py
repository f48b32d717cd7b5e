"""Tests of cpt_jax.distributed.gossip and cpt_jax.data.peers.

Host-side pieces (partitions, compression, mixing matrix, bytes) run in this process.
Everything that needs 8 devices (shard_map + ppermute gossip, the decentralized step)
runs once in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (jax may already be imported
here by other test files, and the device count is fixed at jax's first use).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpt_jax.data import peers as part
from cpt_jax.distributed import gossip as dec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- topology

def test_ring_mixing_matrix_is_symmetric_doubly_stochastic_with_third_weights():
    w = dec.ring_mixing_matrix(8)
    np.testing.assert_allclose(w, w.T)
    np.testing.assert_allclose(w.sum(0), 1.0)
    np.testing.assert_allclose(w.sum(1), 1.0)
    for i in range(8):
        nonzero = sorted(np.flatnonzero(w[i]).tolist())
        assert nonzero == sorted({(i - 1) % 8, i, (i + 1) % 8})
        np.testing.assert_allclose(w[i, nonzero], 1.0 / 3.0)
    np.testing.assert_allclose(dec.ring_mixing_matrix(2), [[1 / 3, 2 / 3], [2 / 3, 1 / 3]])
    np.testing.assert_allclose(dec.ring_mixing_matrix(1), [[1.0]])
    with pytest.raises(ValueError, match="self_weight"):
        dec.ring_mixing_matrix(4, self_weight=0.0)
    with pytest.raises(ValueError, match="num_peers"):
        dec.ring_mixing_matrix(0)


# --------------------------------------------------------------------------- partitions

def _labels(per_class=(120, 100, 90, 110, 100, 130, 100, 95, 105, 100), seed=0):
    labels = np.concatenate([np.full(n, c) for c, n in enumerate(per_class)])
    return np.random.default_rng(seed).permutation(labels)


@pytest.mark.parametrize("skew", [0.0, 0.6, 0.8])
def test_label_skew_partition_follows_the_documented_scheme(skew):
    labels = _labels()
    parts = part.label_skew_partition(labels, 8, skew, seed=3)
    all_idx = np.concatenate(parts)
    assert len(np.unique(all_idx)) == len(all_idx)          # disjoint shards
    n = len(parts[0])
    assert all(len(p) == n for p in parts)                  # equal sizes
    assert n <= len(labels) // 8
    counts = np.bincount(labels, minlength=10)
    expected = part.label_skew_counts(counts, 8, skew, n)
    dom = part.dominant_classes(8, 10)
    for p, idx in enumerate(parts):
        hist = np.bincount(labels[idx], minlength=10)
        np.testing.assert_array_equal(hist, expected[p])
        iid = n - round(skew * n)
        iid_share = np.floor(iid * counts / counts.sum())
        # dominant classes: round(skew n) plus about their IID share
        assert hist[dom[p]].sum() >= round(skew * n) + iid_share[dom[p]].sum()
        assert hist[dom[p]].sum() <= round(skew * n) + iid_share[dom[p]].sum() + len(dom[p]) + 1
    # n is the largest size for which no class runs out
    with pytest.raises(ValueError, match="examples_per_peer"):
        part.label_skew_partition(labels, 8, skew, examples_per_peer=n + 1)


def test_label_skew_zero_is_stratified_and_high_skew_is_skewed():
    labels = _labels()
    iid = part.partition_summary(labels, part.iid_partition(labels, 8))
    skewed = part.partition_summary(labels, part.label_skew_partition(labels, 8, 0.8))
    freq = np.bincount(labels) / len(labels)
    hist = np.array(iid["class_histogram"]) / np.array(iid["sizes"])[:, None]
    assert np.max(np.abs(hist - freq)) < 0.02
    # single-dominant-class peers (2..7): about 0.8 + 0.2 * 0.1 of their data
    assert all(0.79 <= f <= 0.86 for f in skewed["top_class_fraction"][2:])


def test_label_skew_rejects_bad_arguments():
    labels = _labels()
    with pytest.raises(ValueError, match="skew"):
        part.label_skew_partition(labels, 8, 1.0)
    with pytest.raises(ValueError, match="num_peers"):
        part.label_skew_partition(labels, 0, 0.5)
    with pytest.raises(ValueError, match="partition kind"):
        part.partition(labels, 4, "random")


def test_dirichlet_partition_uses_every_example_once_and_alpha_controls_skew():
    labels = _labels()
    small = part.dirichlet_partition(labels, 8, 0.1, seed=1, min_examples=5)
    large = part.dirichlet_partition(labels, 8, 100.0, seed=1, min_examples=5)
    for parts in (small, large):
        all_idx = np.sort(np.concatenate(parts))
        np.testing.assert_array_equal(all_idx, np.arange(len(labels)))
        assert min(len(p) for p in parts) >= 5
    top = lambda ps: np.mean(part.partition_summary(labels, ps)["top_class_fraction"])  # noqa
    assert top(small) > 0.5 > 0.2 > top(large)
    with pytest.raises(ValueError, match="alpha"):
        part.dirichlet_partition(labels, 8, 0.0)


# --------------------------------------------------------------------------- compression

def test_int8_compression_roundtrip_error_is_at_most_half_a_step():
    x = jax.random.normal(jax.random.key(0), (64, 33)) * 3.0
    c = dec.Compression("int8")
    payload = c.encode(x)
    assert payload["codes"].dtype == jnp.int8 and payload["scale"].shape == ()
    scale = float(jnp.max(jnp.abs(x))) / 127
    np.testing.assert_allclose(float(payload["scale"]), scale, rtol=1e-6)
    err = jnp.abs(c.decode(payload, x) - x)
    assert float(err.max()) <= scale / 2 * (1 + 1e-5)
    assert int(jnp.max(jnp.abs(payload["codes"].astype(jnp.int32)))) == 127
    # 4-bit codes: 7 levels on each side
    c4 = dec.Compression("int8", bits=4)
    assert int(jnp.max(jnp.abs(c4.encode(x)["codes"].astype(jnp.int32)))) == 7
    zero = c.decode(c.encode(jnp.zeros(5)), jnp.zeros(5))
    np.testing.assert_array_equal(zero, 0.0)


def test_topk_compression_keeps_the_largest_entries():
    x = jnp.array([[0.1, -5.0, 0.2], [3.0, 0.0, -0.3]])
    c = dec.Compression("topk", fraction=0.34)           # k = ceil(0.34 * 6) = 3
    payload = c.encode(x)
    assert payload["values"].shape == (3,) and payload["indices"].dtype == jnp.int32
    np.testing.assert_allclose(c.decode(payload, x), [[0, -5.0, 0], [3.0, 0, -0.3]])


@pytest.mark.parametrize("kind", dec.COMPRESSIONS)
def test_payload_bytes_equal_the_encoded_arrays(kind):
    c = dec.Compression(kind, fraction=0.1)
    for shape in [(3, 3, 16, 32), (10,), (64, 10)]:
        x = jnp.ones(shape)
        encoded = c.encode(x)
        nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(encoded))
        assert c.payload_bytes(shape) == nbytes
    n = 3 * 3 * 16 * 32
    expected = {"none": 4 * n, "int8": n + 4, "topk": 8 * int(np.ceil(0.1 * n))}[kind]
    assert c.payload_bytes((3, 3, 16, 32)) == expected
    params = {"a": jnp.zeros((3, 3, 16, 32)), "b": jnp.zeros((10,))}
    assert dec.gossip_bytes_per_step(params, c, 8) == 2 * (c.payload_bytes((3, 3, 16, 32))
                                                           + c.payload_bytes((10,)))
    assert dec.gossip_bytes_per_step(params, c, 1) == 0


def test_compression_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        dec.Compression("int4")
    with pytest.raises(ValueError, match="bits"):
        dec.Compression("int8", bits=9)
    with pytest.raises(ValueError, match="fraction"):
        dec.Compression("topk", fraction=0.0)
    with pytest.raises(ValueError, match="gamma"):
        dec.Compression("int8", gamma=1.5)


def test_consensus_distance_and_average():
    x = {"w": jnp.array([[1.0, 2.0], [3.0, 2.0], [2.0, 5.0]]), "b": jnp.array([0.0, 3.0, 0.0])}
    xbar = dec.average_peers(x)
    np.testing.assert_allclose(xbar["w"], [2.0, 3.0])
    # per peer ||x_i - xbar||^2 (w part + b part): (1+1)+1, (1+1)+4, (0+4)+1 -> mean 14/3
    np.testing.assert_allclose(float(dec.consensus_distance(x)), 14.0 / 3.0, rtol=1e-6)


def test_peer_batches_come_from_each_peers_own_shard_without_repeats_in_an_epoch():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (60, 4, 4, 1)).astype(np.uint8)
    labels = np.arange(60) % 5
    parts = [np.arange(0, 20), np.arange(20, 32), np.arange(32, 60)]   # sizes 20, 12, 28
    data = part.make_peer_image_data(images, labels, parts, [0.0], [1.0], 1.0)
    ids = images.reshape(60, -1).astype(np.float64) @ (256.0 ** np.arange(16) % 9973)
    seen = [[] for _ in parts]
    for step in range(3):                      # 12 // 4 = 3 batches: one epoch of peer 1
        batch = part.peer_batch_at_step(data, step, jax.random.key(1), batch_size=4)
        x = np.asarray(batch["inputs"]).reshape(3, 4, -1)
        for p in range(3):
            got = x[p] @ (256.0 ** np.arange(16) % 9973)
            rows = [int(np.flatnonzero(np.isclose(ids, g))[0]) for g in got]
            assert set(rows) <= set(parts[p].tolist())
            np.testing.assert_array_equal(np.asarray(batch["labels"][p]), labels[rows])
            seen[p] += rows
    for p in range(3):
        assert len(set(seen[p])) == len(seen[p])           # no repeats within the epoch
    assert sorted(seen[1]) == parts[1].tolist()             # peer 1 saw its whole shard
    with pytest.raises(ValueError, match="batch_size"):
        part.peer_batch_at_step(data, 0, jax.random.key(0), batch_size=29)


# --------------------------------------------------------------------------- 8 devices

_DEVICE_SCRIPT = textwrap.dedent(r"""
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from cpt_jax import quantize_model, schedules, CPT_RULES
    from cpt_jax.distributed import gossip as dec
    from cpt_jax.models import MLP
    from cpt_jax.training import create_train_state, make_train_step

    assert jax.device_count() == 8, jax.devices()
    out = {}
    mesh = dec.make_peer_mesh(8)
    W = dec.ring_mixing_matrix(8)
    x = {"a": jax.random.normal(jax.random.key(0), (8, 5, 3)),
         "b": jax.random.normal(jax.random.key(1), (8, 7)) * 10}
    x = dec.shard_peers(x, mesh)

    # exact gossip == W @ X, mean kept
    gossip = dec.make_gossip(mesh)
    y, _, _ = gossip(x, None, None)
    out["exact_vs_matrix"] = max(
        float(np.max(np.abs(np.asarray(y[k]) - np.tensordot(W, np.asarray(x[k]), 1))))
        for k in x)
    out["exact_mean_change"] = max(
        float(np.max(np.abs(np.asarray(y[k]).mean(0) - np.asarray(x[k]).mean(0)))) for k in x)
    out["exact_bytes_claimed"] = dec.gossip_bytes_per_step(
        jax.tree_util.tree_map(lambda v: v[0], x), dec.Compression(), 8)
    out["exact_bytes_jaxpr"] = dec.ppermute_bytes(jax.make_jaxpr(gossip)(x, None, None))

    # CHOCO gossip alone: the mean is kept and the peers reach consensus
    for kind in ("int8", "topk"):
        c = dec.Compression(kind, fraction=0.3, gamma=1.0 if kind == "int8" else 0.4)
        g = dec.make_gossip(mesh, c)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, x)   # CHOCO's x^ = 0, s = W x^ = 0
        params, public, mixed = x, zeros, zeros
        mean0 = {k: np.asarray(v).mean(0) for k, v in x.items()}
        d0 = float(dec.consensus_distance(x))
        for _ in range(30):
            params, public, mixed = g(params, public, mixed)
        out[kind + "_mean_change"] = max(
            float(np.max(np.abs(np.asarray(params[k]).mean(0) - mean0[k]))) for k in x)
        out[kind + "_consensus_ratio"] = float(dec.consensus_distance(params)) / d0
        out[kind + "_bytes_claimed"] = dec.gossip_bytes_per_step(
            jax.tree_util.tree_map(lambda v: v[0], x), c, 8)
        out[kind + "_bytes_jaxpr"] = dec.ppermute_bytes(
            jax.make_jaxpr(g)(params, public, mixed))

    # the decentralized step: peers fed the same batch, exact gossip, 8-bit traced
    # precision (errors fp32, so no per-peer randomness) == the single-device step
    model = quantize_model(MLP(hidden=(16,), num_classes=4), rules=CPT_RULES)
    tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
    xb = jax.random.normal(jax.random.key(2), (6, 4, 4, 1))
    yb = jnp.arange(6) % 4
    fwd = schedules.cyclic("cos_growth", min_bits=4, max_bits=8, num_cycles=1, total_steps=3)
    single = create_train_state(model, tx, jax.random.key(3), xb, train=False)
    step1 = make_train_step(model, tx, fwd, None, donate=False)
    state = dec.shard_peers(dec.init_peer_state(model, tx, jax.random.key(3), xb, 8,
                                                train=False), mesh)
    dstep = dec.make_decentralized_step(model, tx, mesh, fwd, None)
    batch = dec.shard_peers({"inputs": jnp.broadcast_to(xb, (8,) + xb.shape),
                             "labels": jnp.broadcast_to(yb, (8, 6))}, mesh)
    bits = []
    for _ in range(3):
        single, m1 = step1(single, {"inputs": xb, "labels": yb})
        state, m8 = dstep(state, batch)
        bits.append(np.asarray(m8["bits"]).tolist())
    out["step_vs_single"] = max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)[None]))),
        state.params, single.params)))
    out["step_bits"] = bits
    out["step_bits_expected"] = np.asarray(schedules.schedule_values(fwd, 3)).tolist()
    out["step_compiles"] = dstep.num_compiles
    out["step_sharding"] = str(jax.tree_util.tree_leaves(state.params)[0].sharding.spec)

    # int8 CHOCO step with different data per peer: bytes in the compiled step
    c = dec.Compression("int8")
    cstate = dec.shard_peers(dec.init_peer_state(model, tx, jax.random.key(3), xb, 8, c,
                                                 train=False), mesh)
    cstep = dec.make_decentralized_step(model, tx, mesh, schedules.constant(8),
                                        schedules.constant(8), compression=c)
    cbatch = dec.shard_peers({"inputs": jax.random.normal(jax.random.key(4), (8, 6, 4, 4, 1)),
                              "labels": jnp.tile(yb, (8, 1))}, mesh)
    out["step_int8_bytes_jaxpr"] = dec.ppermute_bytes(jax.make_jaxpr(
        lambda s, b: cstep._fn(s, b))(cstate, cbatch))
    out["step_int8_bytes_claimed"] = dec.gossip_bytes_per_step(
        jax.tree_util.tree_map(lambda v: v[0], cstate.params), c, 8)
    # Reference for one step: each peer's own local step (make_train_step, its own rng
    # and batch); CHOCO keeps the peers' mean (sum_j W_ij = 1 for s and h alike), so the
    # mean after gossip is the mean of the local steps whatever the int8 messages were.
    local_step = make_train_step(model, tx, schedules.constant(8), schedules.constant(8),
                                 donate=False)
    host = jax.device_get(cstate.train)
    peer = lambda tree, i: jax.tree_util.tree_map(lambda v: v[i], tree)
    halves = [local_step(peer(host, i), peer(jax.device_get(cbatch), i))[0].params
              for i in range(8)]
    local_mean = jax.tree_util.tree_map(lambda *v: np.mean(np.stack(v), 0), *halves)
    for t in range(3):
        cstate, cm = cstep(cstate, cbatch)
        if t == 0:
            out["step_int8_mean_vs_local_mean"] = max(jax.tree_util.tree_leaves(
                jax.tree_util.tree_map(lambda a, b: float(np.max(np.abs(
                    np.asarray(a).mean(0) - b))), cstate.params, local_mean)))
    out["step_int8_finite"] = bool(np.all(np.asarray(cm["finite"])))
    out["step_int8_peers_differ"] = float(dec.consensus_distance(cstate.params)) > 0
    # Identical peers (same state and batch): the int8 messages are equal, the gossip
    # leaves x unchanged (s = h = q), so the step is the single-device step.
    same = dec.shard_peers(dec.init_peer_state(model, tx, jax.random.key(3), xb, 8, c,
                                               train=False), mesh)
    same_step = dec.make_decentralized_step(model, tx, mesh, fwd, None, compression=c)
    single = create_train_state(model, tx, jax.random.key(3), xb, train=False)
    for _ in range(3):
        single, _ = step1(single, {"inputs": xb, "labels": yb})
        same, _ = same_step(same, batch)
    out["step_int8_identical_vs_single"] = max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)[None]))),
        same.params, single.params)))
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def device_results():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _DEVICE_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_exact_gossip_is_the_ring_mixing_matrix_and_keeps_the_mean(device_results):
    assert device_results["exact_vs_matrix"] < 1e-5
    assert device_results["exact_mean_change"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "topk"])
def test_choco_gossip_keeps_the_mean_and_reaches_consensus(device_results, kind):
    assert device_results[kind + "_mean_change"] < 1e-4
    assert device_results[kind + "_consensus_ratio"] < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["exact", "int8", "topk", "step_int8"])
def test_communication_sends_the_bytes_it_claims(device_results, kind):
    claimed = device_results[kind + "_bytes_claimed"]
    assert claimed > 0
    assert device_results[kind + "_bytes_jaxpr"] == claimed


@pytest.mark.slow
def test_decentralized_step_equals_the_single_device_step_on_identical_data(device_results):
    assert device_results["step_vs_single"] < 1e-5
    assert device_results["step_compiles"] == 1
    # the cyclic schedule is evaluated on the traced step, by every peer
    expected = device_results["step_bits_expected"]
    assert len(set(expected)) > 1
    assert device_results["step_bits"] == [[b] * 8 for b in expected]
    assert "peers" in device_results["step_sharding"]


@pytest.mark.slow
def test_compressed_decentralized_training_step_keeps_the_mean_of_the_local_steps(
        device_results):
    # Different data per peer: the mean over peers is that of the independent local steps.
    assert device_results["step_int8_mean_vs_local_mean"] < 1e-5
    assert device_results["step_int8_finite"]
    assert device_results["step_int8_peers_differ"]
    # Identical peers: int8 CHOCO gossip is the identity, the step the single-device one.
    assert device_results["step_int8_identical_vs_single"] < 1e-5
