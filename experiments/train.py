"""The main job: train a (cyclic) low-precision model from an ml_collections config.

    python -m experiments.train --workdir=DIR --config=experiments/configs/default.py \
        [--config.precision.schedule=cos_growth] [--config.num_steps=...] ...

Writes metrics.jsonl, summary.json, plots and TensorBoard events to DIR. A user error
(bad config value, missing data file) ends with a one-line message and exit code 2.
"""
from __future__ import annotations

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, checkpoints and plots.")
config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file.",
                                lock_config=True)
flags.mark_flags_as_required(["workdir", "config"])
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from cpt_jax import distributed
    distributed.maybe_initialize()
    from cpt_jax.runner import train_and_evaluate

    try:
        summary = train_and_evaluate(FLAGS.config, _WORKDIR.value, progress=_PROGRESS.value)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    keys = [k for k in summary if k.startswith("final_")] + [
        "relative_cost_fp32", "relative_cost_static8", "mean_bits", "num_compiles", "steps",
        "wall_time_s"]
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=1))


if __name__ == "__main__":
    app.run(main)
