"""Run the README's "In your own Flax code" snippet as written, for a few steps.

    python scripts/readme_snippet.py [--steps 3] [--installed]

The snippet is read from README.md (the first ```python block after the heading "In
your own Flax code"). It leaves two names to the reader, `MyModel` and `x0`; they are
defined first (a small MLP, one flattened 8x8 image). Then its `train_step` runs
`--steps` steps on random data: the loss must be finite and the step compiled once.

With `--installed` the script also checks that `cpt_jax` came from an installed
package, not from this checkout: CI runs it in a clean virtualenv holding the wheel
alone (`pip install dist/*.whl`, no extras), which is what `pip install cpt_jax` gives.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADING = "## In your own Flax code"

PRELUDE = '''
import flax.linen as nn
import jax.numpy as jnp


class MyModel(nn.Module):   # the reader's model, unmodified
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


x0 = jnp.ones((1, 64))
'''


def readme_snippet(readme: str) -> str:
    """The first python block after `HEADING` in the README's text."""
    after = readme.split(HEADING, 1)
    if len(after) != 2:
        raise ValueError(f"README.md has no heading {HEADING!r}")
    block = re.search(r"```python\n(.*?)```", after[1], flags=re.S)
    if block is None:
        raise ValueError(f"README.md has no python block after {HEADING!r}")
    return block.group(1)


def run(steps: int, installed: bool = False) -> dict:
    """Execute the snippet and `steps` of its `train_step`; return the namespace's
    ``loss``, ``compiles`` and the ``cpt_jax`` it used."""
    with open(os.path.join(ROOT, "README.md")) as f:
        snippet = readme_snippet(f.read())
    namespace: dict = {"__name__": "readme_snippet"}
    exec(compile(PRELUDE + snippet, "README.md (In your own Flax code)", "exec"), namespace)
    import jax
    import jax.numpy as jnp

    cpt_jax = namespace["cpt_jax"]
    if installed and os.path.abspath(cpt_jax.__file__).startswith(ROOT + os.sep):
        raise SystemExit(f"cpt_jax was imported from the checkout ({cpt_jax.__file__}), "
                         "not from an installed package")
    params, opt_state = namespace["params"], namespace["opt_state"]
    train_step = namespace["train_step"]
    keys = jax.random.split(jax.random.key(1), steps)
    loss = None
    for step in range(steps):
        x = jax.random.normal(keys[step], (16, 64))
        y = jnp.arange(16) % 10
        params, opt_state, loss = train_step(params, opt_state, x, y, step)
    compiles = train_step._cache_size()
    if not (loss is not None and bool(jnp.isfinite(loss)) and compiles == 1):
        raise SystemExit(f"README snippet: loss {loss}, {compiles} compilations "
                         "(expected a finite loss and 1)")
    return {"loss": float(loss), "compiles": compiles, "cpt_jax": cpt_jax.__file__}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--installed", action="store_true",
                        help="require cpt_jax from an installed package, not the checkout")
    args = parser.parse_args(argv)
    result = run(args.steps, args.installed)
    print(f"README snippet: {args.steps} steps, loss {result['loss']:.4f}, "
          f"{result['compiles']} compilation, cpt_jax from {result['cpt_jax']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
