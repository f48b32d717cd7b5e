"""Data: image, text and graph datasets, peer splits, and the Grain input pipeline.

Modules (the family at a glance)::

    cpt_jax.data.image     named image datasets (local files -> TFDS), on-device batching
    cpt_jax.data.text      PTB, tiny-shakespeare, SST-2 and their batching
    cpt_jax.data.graph     Planetoid (Cora, CiteSeer) and ogbn-arxiv graphs
    cpt_jax.data.peers     splitting a dataset over peers (IID, label skew, Dirichlet)
    cpt_jax.data.sources   TFDS without TensorFlow: tfds.data_source, then tfds.load
    cpt_jax.data.pipeline  the Grain input pipeline (config.input_pipeline="grain")

A named dataset resolves: local files (``data_dir``) -> a TFDS-prepared directory
(``tfds.data_source``, no TensorFlow) -> ``tfds.load`` when TensorFlow imports -> an
error naming the three options.

``cpt_jax.data`` itself re-exports every name of :mod:`cpt_jax.data.image` (the names
``cpt_jax.data`` had before it became a package), so ``from cpt_jax.data import
load_image_dataset`` and ``cpt_jax.data.batch_at_step`` keep working.

Example:
  >>> from cpt_jax import data
  >>> data.load_image_dataset("digits").num_classes
  10
"""
from cpt_jax.data import graph, image, peers, text  # noqa: F401
from cpt_jax.data.image import *  # noqa: F401,F403
from cpt_jax.data.image import __all__ as _image_all

__all__ = list(_image_all) + ["image", "text", "graph", "peers"]
