"""Metric writers and periodic actions: the runner's record sinks and its every-N-steps work."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cpt_jax.runner import metric_writers as mw
from cpt_jax.runner.periodic_actions import PeriodicAction, run_actions

RECORDS = [("train", 4, {"step": 4, "loss": 0.5, "bits": 3.0, "skipped_steps": 0}),
           ("eval", 4, {"step": 4, "eval_bits": 8.0, "test_accuracy": 0.75}),
           ("train", 8, {"step": 8, "loss": 0.25, "bits": 5.0, "skipped_steps": 1}),
           ("final", 8, {"steps": 8, "interrupted": False, "model": "mlp", "loss": 0.2})]


def _expected_lines(records):
    """metrics.jsonl as documented: train records bare, the others under their kind."""
    out = []
    for kind, _, record in records:
        out.append(record if kind == "train" else {kind: record})
    return out


def test_jsonl_and_memory_writers_write_the_documented_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    mw.write_jsonl(str(path), [{"step": 1, "loss": 9.0}])   # a resumed run's history
    memory = mw.MemoryWriter([{"step": 1, "loss": 9.0}])
    writer = mw.MultiWriter([memory, mw.JsonlWriter(str(path))])
    for kind, step, record in RECORDS:
        writer.write(kind, step, record)
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 9.0}] + _expected_lines(RECORDS)
    assert memory.records == lines


def test_write_jsonl_replaces_the_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    mw.write_jsonl(str(path), [{"step": 1}])
    assert path.read_text() == '{"step": 1}\n'
    assert not (tmp_path / "m.jsonl.tmp").exists()


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="record kind 'summary' is unknown"):
        mw.MemoryWriter().write("summary", 1, {})


def test_numeric_scalars_drop_step_bools_and_strings():
    record = {"step": 3, "loss": 0.5, "steps": 7, "interrupted": True, "model": "cnn",
              "bits": np.float32(4.0).item(), "layers": ["a"]}
    assert mw.numeric_scalars(record) == {"loss": 0.5, "steps": 7, "bits": 4.0}


class _Spy(mw.MetricWriter):
    def __init__(self, log):
        self.log = log

    def write(self, kind, step, record):
        self.log.append(("write", kind, step))

    def flush(self):
        self.log.append(("flush",))

    def close(self):
        self.log.append(("close",))


def test_multi_writer_fans_out_in_order_and_find_writer_looks_inside():
    log = []
    first, second = _Spy(log), _Spy(log)
    writer = mw.MultiWriter([first, mw.MultiWriter([second])])
    writer.write("eval", 2, {"step": 2})
    writer.flush()
    writer.close()
    assert log == [("write", "eval", 2)] * 2 + [("flush",)] * 2 + [("close",)] * 2
    assert mw.find_writer(writer, _Spy) is first
    assert mw.find_writer(writer, mw.JsonlWriter) is None


def test_logging_writer_logs_one_line_per_record(caplog):
    caplog.set_level("INFO")
    writer = mw.LoggingWriter()
    writer.write("train", 4, {"step": 4, "loss": 0.5, "model": "mlp"})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["[train] step 4: loss=0.5"]


# --------------------------------------------------------------------------- actions

# The loop's conditions before it was split into actions (the runner's history).
ORIGINAL = {
    "log": lambda step, every, total: step % every == 0 or step == total,
    "eval": lambda step, every, total: bool(every) and step % every == 0 and step < total,
    "checkpoint": lambda step, every, total: bool(every) and (step % every == 0
                                                               or step == total),
}
FLAGS = {"log": dict(at_last=True), "eval": dict(skip_last=True),
         "checkpoint": dict(at_last=True)}


@pytest.mark.parametrize("kind,every,total", [
    (kind, every, total) for kind in ORIGINAL for every in (0, 1, 3, 5, 12)
    for total in (1, 10, 12) if not (kind == "log" and every == 0)])
def test_periodic_actions_fire_where_the_original_loop_did(kind, every, total):
    fired = []
    action = PeriodicAction(every, lambda step, state, metrics: fired.append(step), total,
                            **FLAGS[kind])
    for step in range(1, total + 1):
        action(step, None, None)
    assert fired == [s for s in range(1, total + 1) if ORIGINAL[kind](s, every, total)]


def test_run_actions_calls_in_order_with_state_and_metrics():
    calls = []
    actions = [PeriodicAction(2, lambda s, st, m: calls.append(("log", s, st, m)), 4,
                              at_last=True),
               PeriodicAction(4, lambda s, st, m: calls.append(("ckpt", s, st, m)), 4)]
    for step in range(1, 5):
        run_actions(actions, step, f"state{step}", {"loss": step})
    assert calls == [("log", 2, "state2", {"loss": 2}), ("log", 4, "state4", {"loss": 4}),
                     ("ckpt", 4, "state4", {"loss": 4})]


def test_negative_period_is_rejected():
    with pytest.raises(ValueError, match="every=-1"):
        PeriodicAction(-1, print, 10)
