"""A stack of NNX blocks in the layer-stack idiom, for tests of shared paths under
``nnx.scan``: the blocks' parameters stacked along a leading axis by ``nnx.vmap``,
the stack run by ``nnx.scan`` with the activations as its carry."""
from __future__ import annotations

from collections.abc import Callable

from flax import nnx


class ScannedBlocks(nnx.Module):
    """``n`` blocks made by ``make_block(rngs)`` under ``nnx.vmap`` (each its own
    initialization), applied in turn by ``nnx.scan``: ``x <- block_i(x)``."""

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs, n: int = 2):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return make_block(rngs)
        self.blocks = create(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)
        return body(x, self.blocks)
