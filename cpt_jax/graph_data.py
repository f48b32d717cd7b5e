"""Deprecated alias: graph data (Planetoid, ogbn-arxiv) moved to :mod:`cpt_jax.data.graph`.

``import cpt_jax.graph_data`` keeps working (with a DeprecationWarning) and gives the same
public names; import ``cpt_jax.data.graph`` instead.
"""
import warnings

warnings.warn("cpt_jax.graph_data is deprecated: import cpt_jax.data.graph instead",
              DeprecationWarning, stacklevel=2)

from cpt_jax.data.graph import *  # noqa: E402,F401,F403
from cpt_jax.data.graph import __all__  # noqa: E402,F401
