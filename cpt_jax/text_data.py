"""Deprecated alias: language data (PTB, tiny-shakespeare, SST-2) moved to :mod:`cpt_jax.data.text`.

``import cpt_jax.text_data`` keeps working (with a DeprecationWarning) and gives the same
public names; import ``cpt_jax.data.text`` instead.
"""
import warnings

warnings.warn("cpt_jax.text_data is deprecated: import cpt_jax.data.text instead",
              DeprecationWarning, stacklevel=2)

from cpt_jax.data.text import *  # noqa: E402,F401,F403
from cpt_jax.data.text import __all__  # noqa: E402,F401
