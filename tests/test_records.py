"""The main job's metric records and writers (`cpt_jax.runner.records`)."""
from __future__ import annotations

import json
import os

from cpt_jax.runner import records
from experiments.configs import default


def test_metrics_jsonl_is_rewritten_from_the_history_then_appended(tmp_path):
    config = default.get_config()
    config.tensorboard = False
    history = [{"kind": "train", "step": 1, "loss": 2.0}]
    path = os.path.join(tmp_path, records.METRICS_FILE)
    with open(path, "w") as f:  # a resumed run's file, with a line past its checkpoint
        f.write(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
        f.write(json.dumps({"kind": "train", "step": 2, "loss": 9.0}) + "\n")
    assert records.writes_files()
    writer, memory = records.make_writers(config, str(tmp_path), history, start_step=1,
                                          progress=False)
    writer.write("train", 2, {"kind": "train", "step": 2, "loss": 1.5})
    writer.flush()
    lines = [json.loads(line) for line in open(path)]
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[-1]["loss"] == 1.5 and memory.records[-1]["loss"] == 1.5
