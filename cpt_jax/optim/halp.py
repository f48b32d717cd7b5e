"""SVRG, LP-SVRG and HALP (De Sa et al. 2018): epoch functions with a full gradient.

These need a full-gradient pass every epoch, which is not an optax update, so they are
epoch functions ``epoch(params, data, key) -> params``: `svrg_epoch` (fp32),
`lp_svrg_epoch` (iterates on a fixed b-bit grid), `halp_epoch` (bit centering: the
offset from an fp32 anchor is stored as b-bit codes of scale
``s = ||g_full|| / (mu (2^(b-1) - 1))``), and the jitted factories `svrg`, `lp_svrg`,
`halp`. `HALPState` is public for custom loops.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from cpt_jax import formats
from cpt_jax.optim.common import Array, Params, check_int, check_positive


def code_dtype(bits: int) -> jnp.dtype:
    """Smallest signed integer dtype holding ``[-2^(b-1), 2^(b-1) - 1]``.

    Example:
      >>> code_dtype(8), code_dtype(12)
      (dtype('int8'), dtype('int16'))
    """
    check_int(bits, "bits", 2)
    if bits > 32:
        raise ValueError(f"bits must be an int in [2, 32], got {bits!r}")
    return jnp.dtype(jnp.int8 if bits <= 8 else jnp.int16 if bits <= 16 else jnp.int32)


def quantize_to_codes(u: Array, scale: Array, bits: Any, *, key: Array,
                      dtype: Any = jnp.int32) -> Array:
    """Integer codes of HALP's quantizer ``Q_{s,b}(u) = s * codes``.

    ``codes = clamp(floor(u / s + U), -2^(b-1), 2^(b-1) - 1)`` with ``U ~ U[0, 1)``
    (unbiased stochastic rounding inside the range). A zero scale gives zero codes.

    Example:
      >>> c = quantize_to_codes(jnp.array([0.26, -9.0]), 0.1, 4,
      ...                       key=jax.random.PRNGKey(0), dtype=jnp.int8)
      >>> int(c[0]) in (2, 3), int(c[1])      # 2.6 rounds to 2 or 3; -90 clamps to -8
      (True, -8)
    """
    b = jnp.asarray(bits, jnp.float32)
    lo, hi = -formats.pow2(b - 1.0), formats.pow2(b - 1.0) - 1.0
    s = jnp.asarray(scale, jnp.float32)
    safe = jnp.where(s > 0, s, 1.0)
    v = jnp.where(s > 0, jnp.asarray(u, jnp.float32) / safe, 0.0)
    noise = jax.random.uniform(key, jnp.shape(u), jnp.float32)
    return jnp.clip(jnp.floor(v + noise), lo, hi).astype(dtype)


def _tree_norm(tree: Params) -> Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(jnp.asarray(x, jnp.float32)))
                        for x in jax.tree_util.tree_leaves(tree)))


def halp_scale(full_grad: Params, mu: Any, bits: Any) -> Array:
    """HALP's bit-centering scale ``s = ||g~|| / (mu (2^(b-1) - 1))`` (global 2-norm).

    The grid ``s * [-2^(b-1), 2^(b-1) - 1]`` then has radius about ``||g~|| / mu``:
    for a ``mu``-strongly convex loss it covers the distance to the optimum.

    Example:
      >>> halp_scale({"w": jnp.array([3.0, 4.0])}, mu=0.1, bits=8)   # 5 / 12.7
      Array(0.39370078, dtype=float32)
    """
    b = jnp.asarray(bits, jnp.float32)
    return _tree_norm(full_grad) / (jnp.asarray(mu, jnp.float32)
                                    * (formats.pow2(b - 1.0) - 1.0))


@struct.dataclass
class HALPState:
    """Bit-centered iterate of HALP: ``w = anchor + scale * codes``.

    Attributes:
      anchor: the centre ``w~`` (float32), where the full gradient was taken.
      full_grad: ``g~ = grad f(w~)`` (float32).
      codes: the offset ``z = scale * codes`` as integers (int8 for b <= 8,
        int16 for b <= 16).
      scale: ``s = ||g~|| / (mu (2^(b-1) - 1))``.
      bits: word length ``b`` of the codes (may be traced; codes stay in
        ``[-2^(b-1), 2^(b-1) - 1]``).

    Example (a custom loop; `halp_epoch` does this for you)::

      state = halp_init(params, bits=8)
      for epoch in range(E):
          g = full_gradient(loss_fn, state.params, data)
          state = state.recenter(g, mu=0.1)              # w~ <- w~ + z, z <- 0
          for t in range(T):
              batch = ...
              gw = jax.grad(loss_fn)(state.params, batch)
              ga = jax.grad(loss_fn)(state.anchor, batch)
              state = state.inner_step(gw, ga, learning_rate=0.1, key=keys[t])
      params = state.params
    """

    anchor: Params
    full_grad: Params
    codes: Params
    scale: Array
    bits: Array

    @property
    def params(self) -> Params:
        """The current iterate ``w~ + s * codes`` (float32)."""
        return jax.tree_util.tree_map(
            lambda a, c: a + self.scale * c.astype(jnp.float32), self.anchor, self.codes)

    @property
    def offset(self) -> Params:
        """The offset ``z = s * codes`` (float32)."""
        return jax.tree_util.tree_map(lambda c: self.scale * c.astype(jnp.float32),
                                      self.codes)

    def recenter(self, full_grad: Params, *, mu: Any = 0.1) -> HALPState:
        """Bit centering: ``w~ <- w~ + z``, ``g~ <- full_grad`` (taken at the new
        ``w~``, i.e. at ``self.params``), ``s <- ||g~|| / (mu (2^(b-1) - 1))``,
        ``z <- 0``."""
        check_positive(mu, "mu")
        return self.replace(
            anchor=self.params,
            full_grad=jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.float32),
                                             full_grad),
            codes=jax.tree_util.tree_map(jnp.zeros_like, self.codes),
            scale=halp_scale(full_grad, mu, self.bits))

    def inner_step(self, grad_at_params: Params, grad_at_anchor: Params,
                   learning_rate: Any, key: Array) -> HALPState:
        """``z <- Q_{s,b}(z - lr (grad_i(w~ + z) - grad_i(w~) + g~))`` on the codes.

        Leaf ``j`` rounds with ``fold_in(key, j)``.
        """
        leaves_c, treedef = jax.tree_util.tree_flatten(self.codes)
        leaves_gw = treedef.flatten_up_to(grad_at_params)
        leaves_ga = treedef.flatten_up_to(grad_at_anchor)
        leaves_g = treedef.flatten_up_to(self.full_grad)
        out = []
        for j, (c, gw, ga, g) in enumerate(zip(leaves_c, leaves_gw, leaves_ga, leaves_g)):
            v = gw - ga + g
            u = self.scale * c.astype(jnp.float32) - learning_rate * v
            out.append(quantize_to_codes(u, self.scale, self.bits,
                                         key=jax.random.fold_in(key, j), dtype=c.dtype))
        return self.replace(codes=jax.tree_util.tree_unflatten(treedef, out))


def halp_init(params: Params, *, bits: Any = 8, dtype: Any = None) -> HALPState:
    """A `HALPState` centred at `params` with ``z = 0`` (call `recenter` before steps).

    Codes are stored in `dtype`, by default `code_dtype(bits)` (int8 at 8 bits);
    with a traced `bits` pass `dtype` large enough for its largest value.

    Example:
      >>> state = halp_init({"w": jnp.zeros(3)}, bits=8)
      >>> state.codes["w"].dtype
      dtype('int8')
    """
    if dtype is None:
        if isinstance(bits, jax.core.Tracer):
            raise ValueError("halp_init with a traced bits needs an explicit dtype")
        bits_v = np.asarray(bits)
        if bits_v.shape != () or float(bits_v) != int(bits_v):
            raise ValueError(f"bits must be an integer in [2, 32], got {bits!r}")
        dtype = code_dtype(int(bits_v))
    elif not isinstance(bits, jax.core.Tracer):
        b = int(np.asarray(bits))
        if not 2 <= b <= jnp.iinfo(dtype).bits:
            raise ValueError(f"bits must be in [2, {jnp.iinfo(dtype).bits}] for codes of "
                             f"dtype {jnp.dtype(dtype)}, got {bits!r}")
    anchor = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params)
    return HALPState(
        anchor=anchor,
        full_grad=jax.tree_util.tree_map(jnp.zeros_like, anchor),
        codes=jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), dtype), anchor),
        scale=jnp.zeros([], jnp.float32),
        bits=jnp.asarray(bits, jnp.float32))


def full_gradient(loss_fn: Callable[[Params, Any], Array], params: Params, data: Any, *,
                  batch_size: int | None = None) -> Params:
    """Gradient of the mean loss over all of `data`: ``g = (1/N) sum_i grad f_i(w)``.

    `loss_fn(params, batch)` returns the mean loss of a batch. With `batch_size` the
    data is processed in chunks (``lax.scan``) and the chunk gradients are averaged
    with weights ``len(chunk) / N``; otherwise one call on the whole data.

    Example:
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 5)); y = x @ jnp.arange(5.0)
      >>> loss_fn = lambda w, batch: 0.5 * jnp.mean((batch[0] @ w - batch[1]) ** 2)
      >>> params = jnp.zeros(5)
      >>> g = full_gradient(loss_fn, params, (x, y), batch_size=64)   # 4 chunks
      >>> bool(jnp.allclose(g, jax.grad(loss_fn)(params, (x, y)), atol=1e-5))
      True
    """
    n = _num_examples(data)
    grad_fn = jax.grad(loss_fn)
    if batch_size is None or batch_size >= n:
        return grad_fn(params, data)
    check_int(batch_size, "batch_size", 1)
    full, rem = divmod(n, batch_size)
    head = jax.tree_util.tree_map(
        lambda a: a[: full * batch_size].reshape((full, batch_size) + a.shape[1:]), data)

    def body(acc, chunk):
        g = grad_fn(params, chunk)
        return jax.tree_util.tree_map(lambda s, x: s + x * (batch_size / n), acc, g), None

    zero = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    total, _ = jax.lax.scan(body, zero, head)
    if rem:
        tail = jax.tree_util.tree_map(lambda a: a[full * batch_size:], data)
        total = jax.tree_util.tree_map(lambda s, x: s + x * (rem / n), total,
                                       grad_fn(params, tail))
    return total


def _num_examples(data: Any) -> int:
    leaves = jax.tree_util.tree_leaves(data)
    if not leaves:
        raise ValueError("data must be a non-empty pytree of arrays with a leading "
                         "example dimension")
    n = int(jnp.shape(leaves[0])[0])
    for leaf in leaves:
        if jnp.shape(leaf)[0] != n:
            raise ValueError(f"every leaf of data must have the same leading dimension, "
                             f"got {[jnp.shape(x)[0] for x in leaves]}")
    return n


def minibatch_indices(key: Array, n: int, batch_size: int, num_steps: int) -> Array:
    """``(num_steps, batch_size)`` example indices: consecutive slices of random
    permutations of ``range(n)`` (a fresh permutation, ``fold_in(key, p)``, for pass
    ``p`` once ``n // batch_size`` batches are used; the remainder is dropped)."""
    per_pass = n // batch_size
    passes = -(-num_steps // per_pass)
    perms = jax.vmap(lambda p: jax.random.permutation(jax.random.fold_in(key, p), n))(
        jnp.arange(passes))
    return perms[:, : per_pass * batch_size].reshape(-1, batch_size)[:num_steps]


def _check_epoch_args(data: Any, learning_rate: Any, batch_size: int,
                      num_steps: int | None) -> tuple[int, int]:
    n = _num_examples(data)
    check_positive(learning_rate, "learning_rate")
    check_int(batch_size, "batch_size", 1)
    if batch_size > n:
        raise ValueError(f"batch_size must be in [1, N={n}], got {batch_size}")
    if num_steps is None:
        num_steps = n // batch_size
    check_int(num_steps, "num_steps", 1)
    return n, num_steps


def _take(data: Any, idx: Array) -> Any:
    return jax.tree_util.tree_map(lambda a: a[idx], data)


def svrg_epoch(loss_fn: Callable[[Params, Any], Array], params: Params, data: Any,
               key: Array, *, learning_rate: Any, batch_size: int,
               num_steps: int | None = None, full_batch_size: int | None = None
               ) -> Params:
    """One outer iteration of full-precision SVRG (Johnson & Zhang 2013).

    ``w~ = w``, ``g~ = grad f(w~)``; then ``T = num_steps`` (default one pass,
    ``N // batch_size``) steps ``w <- w - lr (grad_i(w) - grad_i(w~) + g~)`` on
    minibatches ``i``; returns the last iterate.

    Example:
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 5)); y = x @ jnp.arange(5.0)
      >>> loss_fn = lambda w, batch: 0.5 * jnp.mean((batch[0] @ w - batch[1]) ** 2)
      >>> params = jnp.zeros(5)
      >>> for e in range(10):
      ...     params = svrg_epoch(loss_fn, params, (x, y), jax.random.PRNGKey(e),
      ...                         learning_rate=0.2, batch_size=16)
      >>> float(jnp.abs(params - jnp.arange(5.0)).max()) < 1e-3
      True
    """
    n, num_steps = _check_epoch_args(data, learning_rate, batch_size, num_steps)
    grad_fn = jax.grad(loss_fn)
    anchor = params
    g_full = full_gradient(loss_fn, anchor, data, batch_size=full_batch_size)
    idx = minibatch_indices(key, n, batch_size, num_steps)

    def body(w, i):
        batch = _take(data, i)
        v = jax.tree_util.tree_map(lambda a, b, c: a - b + c, grad_fn(w, batch),
                                   grad_fn(anchor, batch), g_full)
        return jax.tree_util.tree_map(lambda p, d: p - learning_rate * d, w, v), None

    params, _ = jax.lax.scan(body, params, idx)
    return params


def lp_svrg_epoch(loss_fn: Callable[[Params, Any], Array], params: Params, data: Any,
                  key: Array, *, learning_rate: Any, batch_size: int, scale: Any,
                  bits: int = 8, num_steps: int | None = None,
                  full_batch_size: int | None = None) -> Params:
    """One outer iteration of low-precision SVRG on a fixed grid (no re-centering).

    The iterates are stored as `bits`-bit integer codes of a fixed scale ``s``:
    ``w = s * c``. Start ``c = Q_{s,b}(params)``, ``w~ = s c``, ``g~ = grad f(w~)``,
    then ``T`` steps ``c <- codes of Q_{s,b}(w - lr (grad_i(w) - grad_i(w~) + g~))``.
    The grid never shrinks, so the iterates stall at a floor set by ``s``.

    Example:
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 5)); y = x @ jnp.arange(5.0)
      >>> loss_fn = lambda w, batch: 0.5 * jnp.mean((batch[0] @ w - batch[1]) ** 2)
      >>> params = jnp.zeros(5)
      >>> for e in range(2):
      ...     params = lp_svrg_epoch(loss_fn, params, (x, y), jax.random.PRNGKey(e),
      ...                            learning_rate=0.2, batch_size=16, scale=2.0 ** -4, bits=8)
      >>> bool(jnp.all(params == jnp.round(params * 16) / 16))    # on the grid
      True
    """
    n, num_steps = _check_epoch_args(data, learning_rate, batch_size, num_steps)
    check_positive(scale, "scale")
    dtype = code_dtype(bits)
    grad_fn = jax.grad(loss_fn)
    k_start, k_batches, k_steps = jax.random.split(key, 3)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    codes = jax.tree_util.tree_unflatten(treedef, [
        quantize_to_codes(p, scale, bits, key=jax.random.fold_in(k_start, j), dtype=dtype)
        for j, p in enumerate(leaves)])
    value = lambda c: jax.tree_util.tree_map(  # noqa: E731
        lambda x: scale * x.astype(jnp.float32), c)
    anchor = value(codes)
    g_full = full_gradient(loss_fn, anchor, data, batch_size=full_batch_size)
    idx = minibatch_indices(k_batches, n, batch_size, num_steps)

    def body(c, ti):
        t, i = ti
        batch = _take(data, i)
        w = value(c)
        v = jax.tree_util.tree_map(lambda a, b, g: a - b + g, grad_fn(w, batch),
                                   grad_fn(anchor, batch), g_full)
        k = jax.random.fold_in(k_steps, t)
        new = [quantize_to_codes(x - learning_rate * d, scale, bits,
                                 key=jax.random.fold_in(k, j), dtype=dtype)
               for j, (x, d) in enumerate(zip(treedef.flatten_up_to(w),
                                              treedef.flatten_up_to(v)))]
        return jax.tree_util.tree_unflatten(treedef, new), None

    codes, _ = jax.lax.scan(body, codes, (jnp.arange(num_steps), idx))
    return value(codes)


def halp_epoch(loss_fn: Callable[[Params, Any], Array], params: Params, data: Any,
               key: Array, *, learning_rate: Any, batch_size: int, mu: Any = 0.1,
               bits: int = 8, num_steps: int | None = None,
               full_batch_size: int | None = None) -> Params:
    """One outer iteration of HALP (SVRG with bit centering, De Sa et al. 2018).

    ::

        w~ = params,  g~ = grad f(w~)                      (full precision)
        s  = ||g~|| / (mu (2^(b-1) - 1)),  z = 0           (bit centering)
        repeat T times, minibatch i:
            z <- Q_{s,b}(z - lr (grad_i(w~ + z) - grad_i(w~) + g~))
        return w~ + z                                      (anchor update)

    with ``Q_{s,b}(u) = s clamp(floor(u/s + U), -2^(b-1), 2^(b-1) - 1)`` and ``z``
    held as int8 codes at ``b <= 8``. The grid radius ``~||g~||/mu`` shrinks with
    the gradient, so at 8 bits HALP converges linearly like SVRG. ``mu`` plays the
    role of the strong-convexity constant (smaller: wider, coarser grid).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 5))
      >>> y = x @ jnp.arange(5.0)
      >>> def loss_fn(w, batch):
      ...     xb, yb = batch
      ...     return 0.5 * jnp.mean((xb @ w - yb) ** 2) + 0.5e-2 * jnp.sum(w ** 2)
      >>> w = jnp.zeros(5)
      >>> epoch = jax.jit(lambda w, key: halp_epoch(loss_fn, w, (x, y), key,
      ...                 learning_rate=0.05, batch_size=8, mu=1.0, bits=8))
      >>> for e in range(10):
      ...     w = epoch(w, jax.random.PRNGKey(e))
      >>> float(jnp.linalg.norm(full_gradient(loss_fn, w, (x, y)))) < 1e-4
      True
    """
    n, num_steps = _check_epoch_args(data, learning_rate, batch_size, num_steps)
    check_positive(mu, "mu")
    grad_fn = jax.grad(loss_fn)
    state = halp_init(params, bits=bits)
    state = state.recenter(full_gradient(loss_fn, state.params, data,
                                         batch_size=full_batch_size), mu=mu)
    k_batches, k_steps = jax.random.split(key)
    idx = minibatch_indices(k_batches, n, batch_size, num_steps)
    anchor = state.anchor

    def body(st, ti):
        t, i = ti
        batch = _take(data, i)
        return st.inner_step(grad_fn(st.params, batch), grad_fn(anchor, batch),
                             learning_rate, jax.random.fold_in(k_steps, t)), None

    state, _ = jax.lax.scan(body, state, (jnp.arange(num_steps), idx))
    return state.params


def _epoch_factory(epoch_fn, loss_fn, kwargs):
    fn = functools.partial(epoch_fn, loss_fn, **kwargs)
    return jax.jit(lambda params, data, key: fn(params, data, key))


def svrg(loss_fn: Callable[[Params, Any], Array], *, learning_rate: float, batch_size: int,
         num_steps: int | None = None, full_batch_size: int | None = None
         ) -> Callable[[Params, Any, Array], Params]:
    """Jitted `svrg_epoch`: ``epoch(params, data, key) -> params``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> mean loss`` of a batch (a pytree slice of
        ``data`` along axis 0).
      learning_rate: the inner step size (> 0).
      batch_size: minibatch size of the inner steps.
      num_steps: inner steps per epoch (default one pass, ``N // batch_size``).
      full_batch_size: chunk size of the full-gradient pass (None: one call).

    Returns:
      ``epoch(params, data, key) -> params``, jitted.

    Example:
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 5)); y = x @ jnp.arange(5.0)
      >>> loss_fn = lambda w, batch: 0.5 * jnp.mean((batch[0] @ w - batch[1]) ** 2)
      >>> params = jnp.zeros(5)
      >>> epoch = svrg(loss_fn, learning_rate=0.2, batch_size=16)
      >>> for e in range(10):
      ...     params = epoch(params, (x, y), jax.random.PRNGKey(e))
      >>> float(jnp.abs(params - jnp.arange(5.0)).max()) < 1e-3
      True
    """
    check_positive(learning_rate, "learning_rate")
    check_int(batch_size, "batch_size", 1)
    return _epoch_factory(svrg_epoch, loss_fn, dict(
        learning_rate=learning_rate, batch_size=batch_size, num_steps=num_steps,
        full_batch_size=full_batch_size))


def lp_svrg(loss_fn: Callable[[Params, Any], Array], *, learning_rate: float,
            batch_size: int, scale: float, bits: int = 8, num_steps: int | None = None,
            full_batch_size: int | None = None) -> Callable[[Params, Any, Array], Params]:
    """Jitted `lp_svrg_epoch` (fixed grid ``scale * [-2^(b-1), 2^(b-1)-1]``).

    Args:
      loss_fn: ``loss_fn(params, batch) -> mean loss`` of a batch.
      learning_rate: the inner step size (> 0).
      batch_size: minibatch size of the inner steps.
      scale: the grid step ``s`` (> 0).
      bits: code width ``b`` (2 to 32).
      num_steps: inner steps per epoch (default one pass).
      full_batch_size: chunk size of the full-gradient pass (None: one call).

    Returns:
      ``epoch(params, data, key) -> params``, jitted; the iterates lie on the grid.

    Example:
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 5)); y = x @ jnp.arange(5.0)
      >>> loss_fn = lambda w, batch: 0.5 * jnp.mean((batch[0] @ w - batch[1]) ** 2)
      >>> params = jnp.zeros(5)
      >>> epoch = lp_svrg(loss_fn, learning_rate=0.2, batch_size=16, scale=2.0 ** -4)
      >>> params = epoch(params, (x, y), jax.random.PRNGKey(0))
      >>> bool(jnp.all(params == jnp.round(params * 16) / 16))
      True
    """
    check_positive(learning_rate, "learning_rate")
    check_positive(scale, "scale")
    code_dtype(bits)
    return _epoch_factory(lp_svrg_epoch, loss_fn, dict(
        learning_rate=learning_rate, batch_size=batch_size, scale=scale, bits=bits,
        num_steps=num_steps, full_batch_size=full_batch_size))


def halp(loss_fn: Callable[[Params, Any], Array], *, learning_rate: float, batch_size: int,
         mu: float = 0.1, bits: int = 8, num_steps: int | None = None,
         full_batch_size: int | None = None) -> Callable[[Params, Any, Array], Params]:
    """Jitted `halp_epoch`: ``epoch(params, data, key) -> params``.

    Each epoch re-centres the `bits`-bit grid on the anchor with scale
    ``s = ||g~|| / (mu (2^(b-1) - 1))``, so the grid shrinks as the gradient does.

    Args:
      loss_fn: ``loss_fn(params, batch) -> mean loss`` of a batch.
      learning_rate: the inner step size (> 0).
      batch_size: minibatch size of the inner steps.
      mu: the strong-convexity constant setting the grid radius ``||g~|| / mu`` (> 0).
      bits: code width ``b`` (2 to 32; int8 codes up to 8).
      num_steps: inner steps per epoch (default one pass).
      full_batch_size: chunk size of the full-gradient pass (None: one call).

    Returns:
      ``epoch(params, data, key) -> params``, jitted.

    Example:
      >>> x = jax.random.normal(jax.random.PRNGKey(0), (256, 5)); y = x @ jnp.arange(5.0)
      >>> loss_fn = lambda w, batch: 0.5 * jnp.mean((batch[0] @ w - batch[1]) ** 2)
      >>> params = jnp.zeros(5)
      >>> epoch = halp(loss_fn, learning_rate=0.2, batch_size=16, mu=1.0, bits=8)
      >>> for e in range(10):
      ...     params = epoch(params, (x, y), jax.random.PRNGKey(e))
      >>> float(jnp.abs(params - jnp.arange(5.0)).max()) < 1e-3
      True
    """
    check_positive(learning_rate, "learning_rate")
    check_positive(mu, "mu")
    code_dtype(bits)
    return _epoch_factory(halp_epoch, loss_fn, dict(
        learning_rate=learning_rate, batch_size=batch_size, mu=mu, bits=bits,
        num_steps=num_steps, full_batch_size=full_batch_size))
