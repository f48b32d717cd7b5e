"""The mesh axes a value varies over inside ``jax.shard_map``, and making values agree.

Under ``jax.shard_map`` (``check_vma=True``, the default) every value's type carries
the manual mesh axes it varies over (printed ``f32[8]{V:peers}``): a per-device
parameter, batch or key varies, a replicated one does not. JAX joins the types of a
primitive's operands itself, but two places need values of one type and do not:

- the branches of a ``lax.cond`` / ``lax.switch`` / ``lax.platform_dependent``
  must return values of the same types;
- a ``custom_vjp`` backward must return, for each primal input, a cotangent of that
  input's type: a product of a replicated weight and a per-device activation has a
  per-device weight gradient, which must be summed over the devices (``psum``), what
  JAX's own transpose of the implicit ``pcast`` does for a plain ``dot_general``.

`vary_like` casts values to the union of the axes of some others (``jax.lax.pcast(...,
to="varying")``: the values are unchanged, only their type); applied to a
``custom_vjp``'s differentiable inputs, JAX's transpose of that cast sums their
cotangents over the devices. Outside ``shard_map`` nothing varies and both are no-ops.

Reading a value's axes is not public API: `varying_axes` is the one place that does,
for the JAX releases supported (``aval.manual_axis_type.varying`` since JAX 0.8,
``aval.vma`` before), checked by ``cpt_jax.interception._jax_internals.check``.
"""
from __future__ import annotations

import jax

Array = jax.Array


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over (empty outside ``jax.shard_map``, and for
    None or a Python number).

    Example:
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
      >>> seen = []
      >>> _ = jax.shard_map(lambda x, y: seen.append((varying_axes(x), varying_axes(y))) or x,
      ...                   mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))(
      ...                   jnp.ones(2), jnp.ones(2))
      >>> seen, varying_axes(jnp.ones(2))
      ([(frozenset({'i'}), frozenset())], frozenset())
    """
    if x is None or isinstance(x, (bool, int, float, complex)):
        return frozenset()
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # JAX >= 0.8
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))     # JAX 0.6 - 0.7


def vary_like(values, *others):
    """Each array of the pytree `values`, cast to vary over every axis that any leaf
    of `values` or `others` varies over (unchanged where it already does).

    Example:
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
      >>> seen = []
      >>> def f(x, w):
      ...   seen.append(varying_axes(vary_like(w, x)))
      ...   return x
      >>> _ = jax.shard_map(f, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))(
      ...     jnp.ones(2), jnp.ones(2))
      >>> seen
      [frozenset({'i'})]
    """
    leaves = jax.tree.leaves((values, others))
    axes = frozenset().union(*(varying_axes(v) for v in leaves))
    if not axes:
        return values

    def cast(v):
        missing = axes - varying_axes(v)
        if v is None or not missing:
            return v
        return jax.lax.pcast(v, tuple(sorted(missing)), to="varying")

    return jax.tree.map(cast, values)


__all__ = ["vary_like", "varying_axes"]
