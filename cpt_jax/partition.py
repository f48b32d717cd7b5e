"""Deprecated alias: peer splits (IID, label skew, Dirichlet) moved to :mod:`cpt_jax.data.peers`.

``import cpt_jax.partition`` keeps working (with a DeprecationWarning) and gives the same
public names; import ``cpt_jax.data.peers`` instead.
"""
import warnings

warnings.warn("cpt_jax.partition is deprecated: import cpt_jax.data.peers instead",
              DeprecationWarning, stacklevel=2)

from cpt_jax.data.peers import *  # noqa: E402,F401,F403
from cpt_jax.data.peers import __all__  # noqa: E402,F401
