"""Saved outputs of every quantizer preset: the reference a format refactor must match.

    python scripts/format_goldens.py            # compare with tests/data/format_goldens.json
    python scripts/format_goldens.py --write    # (re)record this jax version's outputs
    python scripts/format_goldens.py --add-new  # record a new preset's, keep the others
    python scripts/format_goldens.py --add-new --only nf4   # compute and record only nf4
    python scripts/format_goldens.py --write-machine  # this CPU class's last-bit differences
    python scripts/format_goldens.py --write-release  # this jax release's last-bit differences

For every registered `cpt_jax.PRESETS` recipe, on fixed inputs that include zeros, +-inf, NaN,
subnormals and magnitudes from 1e-30 to 1e30:

- ``quantize(x, bits, fmt, rounding, key)`` of its weight, activation and error
  formats (those not kept in full precision) at every width in `WIDTHS` (a width the format refuses is recorded as
  refused), with the format's own rounding (stochastic with a fixed key);
- one quantized Dense product through the preset's provider: the forward output and
  the gradients of the input and the kernel, at 4 and 8 bits (errors at the same
  width), a fixed rounding key.

Each output is recorded as the SHA-256 of its bytes (float32, C order), keyed by
jax's ``major.minor`` version: XLA's CPU code may legitimately differ in the last
bit between jax releases, never within one. A patch release can too (jax 0.12.1
sums a Dense product in another order than 0.12.0.1: 1e-6 apart, so an 8-bit error
near a grid boundary rounds to the neighbouring code): its outputs that differ from
its ``major.minor`` section are saved in a section of its own (``"0.12.1"``,
``--write-release``), and so are a CPU class's (``"0.12+avx2"``, ``--write-machine``).
`tests/test_format_goldens.py` compares.
To record the goldens of a past commit (before a change): check it out in a
worktree and run ``--write`` there, then copy the file.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import flax.linen as nn  # noqa: E402

os.environ.setdefault("CPT_JAX_INT_GEMM", "none")  # fake quantization on every host (not AMX-only integers)
import cpt_jax  # noqa: E402
from cpt_jax import formats  # noqa: E402

GOLDENS = os.path.join(ROOT, "tests", "data", "format_goldens.json")
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32)
PRODUCT_WIDTHS = (4, 8)
KEY = 20261204


def jax_version() -> str:
    return ".".join(jax.__version__.split(".")[:2])


def machine_class() -> str:
    """The CPU class whose XLA code may round differently in the last bit: ``avx512``
    (the machines the goldens were first recorded on) or ``avx2``."""
    try:
        flags = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return "avx512"
    return "avx512" if " avx512f" in flags else "avx2"


def jax_release() -> str:
    """jax's whole version (``0.12.1``): a section of the goldens overriding its
    ``major.minor`` section where the release rounds differently."""
    return jax.__version__


def sections(version: str, release: str | None = None) -> tuple[str, ...]:
    """The goldens' sections for this jax, each overriding the ones before: its
    ``major.minor``, this CPU class's differences, the release's, the release's on
    this CPU class.

    Example:
      >>> sections("0.12", "0.12.1")[::2]
      ('0.12', '0.12.1')
    """
    release = release or jax_release()
    own = (release,) if release != version else ()
    return tuple(s for v in (version, *own) for s in (v, f"{v}+{machine_class()}"))


def expected(saved: dict, version: str, release: str | None = None) -> dict:
    """This jax version's outputs, with the entries this CPU class or this release
    records differently (sections ``"<version>+<class>"``: `--write-machine`;
    ``"<release>"``: `--write-release`)."""
    out: dict = {}
    for section in sections(version, release):
        out.update(saved.get(section, {}))
    return out


def special_inputs(rows: int = 16, cols: int = 256) -> np.ndarray:
    """Normal values at one magnitude per row (1e-30 .. 1e30), with specials."""
    rng = np.random.default_rng(0)
    scales = np.logspace(-30, 30, rows)
    x = rng.normal(size=(rows, cols)) * scales[:, None]
    x[0, :] = 0.0                      # an all-zero row
    x[1, ::7] = 0.0                    # scattered zeros
    x[2, 3], x[2, 5], x[2, 9] = np.inf, -np.inf, np.nan
    x[3, :4] = [1e-45, -1e-42, 3e-39, 1.2e-38]  # subnormals
    x[4, :8] = [0.5, 1.5, 2.5, -0.5, -1.5, 0.25, 0.75, -2.5]  # ties
    return x.astype(np.float32)


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a, np.float32)).tobytes()).hexdigest()[:16]


def quantize_entries(name: str, config) -> dict:
    """The digests of the preset's three formats at every width (traced, as in training)."""
    x = jnp.asarray(special_inputs())
    key = jax.random.key(KEY)
    out = {}
    for role in ("weight", "activation", "error"):
        tq = getattr(config, role)
        if tq is None:  # kept in full precision (a weight-only preset): nothing to record
            continue
        k = key if tq.rounding == "stochastic" else None
        run = jax.jit(lambda x, bits, tq=tq, k=k: formats.quantize(
            x, bits, tq.fmt, rounding=tq.rounding, key=k))
        for bits in WIDTHS:
            tag = f"{name}/{role}/{bits}"
            try:  # the static checks of the width
                jax.eval_shape(lambda x, bits=bits, tq=tq, k=k: formats.quantize(
                    x, bits, tq.fmt, rounding=tq.rounding, key=k), x)
            except ValueError:
                out[tag] = "refused"
                continue
            out[tag] = digest(run(x, jnp.float32(bits)))
    return out


def product_entries(name: str, config) -> dict:
    """The digests of one Dense product's output and gradients through the preset."""
    model = cpt_jax.quantize_model(nn.Dense(64), config=config)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(32, 128)), jnp.float32)
    variables = model.init(jax.random.key(0), x)
    params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}

    @jax.jit
    def outputs(params, x, bits):
        def loss(params, x):
            with cpt_jax.precision(bits, grad_bits=bits, rng=jax.random.key(KEY)):
                y = model.apply({"params": params, **rest}, x)
            return jnp.sum(jnp.sin(y)), y
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    out = {}
    for bits in PRODUCT_WIDTHS:
        (gp, gx), y = outputs(params, x, jnp.float32(bits))
        out[f"{name}/product/{bits}/y"] = digest(y)
        out[f"{name}/product/{bits}/dx"] = digest(gx)
        out[f"{name}/product/{bits}/dkernel"] = digest(gp["kernel"])
    return out


def record_preset(name: str) -> dict:
    """The digests of one registered preset (its formats, then its product)."""
    config = cpt_jax.get_preset(name)
    return {**quantize_entries(name, config), **product_entries(name, config)}


def record() -> dict:
    out = {}
    for name in sorted(cpt_jax.PRESETS):
        out.update(record_preset(name))
    return out


def recorded_presets(entries: dict) -> set[str]:
    """The presets with outputs in `entries` (one jax version's goldens)."""
    return {key.split("/")[0] for key in entries}


RECORD_COMMAND = "python scripts/format_goldens.py --add-new --only"
"""Followed by a preset's name: records its outputs for the running jax version."""


def presets_of(only: str) -> list[str]:
    """The registered presets whose outputs' keys start with one of the comma-separated
    prefixes of `only` (all of them when it is empty).

    Example:
      >>> presets_of("nf4"), presets_of("mxfp4/")
      (['nf4'], ['mxfp4'])
    """
    prefixes = tuple(p for p in only.split(",") if p)
    return [n for n in sorted(cpt_jax.PRESETS)
            if not prefixes or any(f"{n}/".startswith(p) or p.startswith(f"{n}/")
                                   for p in prefixes)]


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="record this jax version's outputs")
    parser.add_argument("--add-new", action="store_true",
                        help="record only the outputs not saved yet (a new preset), keep the rest")
    parser.add_argument("--write-machine", action="store_true",
                        help="record the outputs this CPU class gives differently from the "
                             "saved ones (XLA's last-bit differences between CPUs)")
    parser.add_argument("--write-release", action="store_true",
                        help="record the outputs this jax release gives differently from its "
                             "major.minor section (a patch release's last-bit differences)")
    parser.add_argument("--only", default="",
                        help="compute only the outputs whose key starts with one of these "
                             "comma-separated prefixes (e.g. a preset's name); with --write, "
                             "re-record only those (a preset whose computation changed on "
                             "purpose), with --add-new record a new preset's; keep the rest")
    args = parser.parse_args(argv)
    prefixes = tuple(p for p in args.only.split(",") if p)
    current = {k: v for name in presets_of(args.only) for k, v in record_preset(name).items()
               if not prefixes or k.startswith(prefixes)}
    saved = json.load(open(GOLDENS)) if os.path.exists(GOLDENS) else {}
    version = jax_version()
    if args.write_machine or args.write_release:
        if args.write_release and args.write_machine:
            print("--write-release or --write-machine, not both", file=sys.stderr)
            return 2
        if args.write_release and jax_release() == version:
            print(f"jax {jax_release()} is its major.minor section: use --write", file=sys.stderr)
            return 2
        section = (jax_release() if args.write_release else version) + (
            f"+{machine_class()}" if args.write_machine else "")
        base = expected(saved, version, release=version) if args.write_release else saved.get(
            version, {})
        kept = {k: v for k, v in saved.get(section, {}).items()
                if prefixes and not k.startswith(prefixes)}
        saved[section] = {**kept, **{k: v for k, v in current.items() if base.get(k) != v}}
        _save(saved)
        print(f"recorded {len(saved[section])} outputs in section {section}")
        return 0
    if prefixes and args.write:
        current = {**saved.get(version, {}), **current}
    if args.add_new:
        new = {k: v for k, v in current.items() if k not in saved.get(version, {})}
        current = {**current, **saved.get(version, {})}
        print(f"adding {len(new)} new outputs: {sorted({k.split('/')[0] for k in new})}")
    if args.write or args.add_new:
        saved[version] = current
        _save(saved)
        print(f"recorded {len(current)} outputs for jax {version} in {GOLDENS}")
        return 0
    if version not in saved:
        print(f"no goldens for jax {version} in {GOLDENS}", file=sys.stderr)
        return 2
    want = {k: v for k, v in expected(saved, version).items()
            if not prefixes or k.startswith(prefixes)}
    changed = compare(want, current)
    for k in changed:
        print(f"{k}: saved {want.get(k)} now {current.get(k)}")
    new = sorted(set(current) - set(saved[version]))
    if new:
        print(f"{len(new)} outputs not saved yet (record them with --add-new): {new[:5]} ...")
    print(f"{len(want) - len(changed)} of {len(want)} outputs as saved (jax {version})")
    return 1 if changed else 0


def _save(saved: dict) -> None:
    os.makedirs(os.path.dirname(GOLDENS), exist_ok=True)
    with open(GOLDENS, "w") as f:
        json.dump(saved, f, indent=0, sort_keys=True)
        f.write("\n")


def compare(saved: dict, current: dict) -> list[str]:
    """The saved outputs that changed or are no longer produced."""
    return sorted(k for k in saved if current.get(k) != saved[k])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
