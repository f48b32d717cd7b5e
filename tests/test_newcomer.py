"""What a newcomer meets (issue 30): every name the README and the docs list works
where they say it does, errors are one line naming the flag or file, ``--help``
shows the config, the plots show every step.

The tables are read from the documents themselves (README's recipes row, the preset
table of docs/formats.md, the schedules, formats, controllers and ``--config.*``
fields written in README.md, BUILD.md and docs/), then passed through the main job's
command line parser and config validation (`train_cli` with the job itself stubbed:
milliseconds per name). ``-m slow``: a 3-step run per preset, no two presets ending
at the same parameters unless docs/formats.md names them as computing the same
numbers.
"""
from __future__ import annotations

import errno
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT = "--config=experiments/configs/default.py"
DOCS = [ROOT / "README.md", ROOT / "BUILD.md", *sorted((ROOT / "docs").glob("*.md"))]


def read(name: str) -> str:
    return (ROOT / name).read_text()


@pytest.fixture
def parse_only(train_cli, monkeypatch):
    """``parse_only(*args) -> (exit_code, stderr, config)``: the command line parsed and
    the config validated as the job does, nothing built (config None on an error)."""
    from cpt_jax.runner import job

    seen = {}

    def fake_job(config, workdir, **kwargs):
        if seen.get("validate", True):
            job.validate_config(config)
        seen["config"] = config
        return {}

    monkeypatch.setattr(job, "train_and_evaluate", fake_job)

    def run(*args, validate=True):
        seen.clear()
        seen["validate"] = validate
        if not any(a.startswith("--workdir") for a in args):
            args = ("--workdir=/tmp/cpt_newcomer_unused", *args)
        if not any(a.startswith("--config=") for a in args):
            args = (DEFAULT, *args)
        code, err = train_cli(*args)
        return code, err, seen.get("config")

    return run


# --------------------------------------------------------------------------- the tables

def readme_presets() -> list[str]:
    row = next(line for line in read("README.md").splitlines()
               if line.startswith("| `cpt_jax.PRESETS`"))
    listed = row.split("):", 1)[1]
    return re.findall(r"`([a-z0-9_]+)`", listed)


def formats_doc_presets() -> list[str]:
    text = read("docs/formats.md")
    table = text.split("| preset | weights |", 1)[1].split("\n\n", 1)[0]
    names = []
    for line in table.splitlines()[2:]:
        first = line.split("|")[1]
        names += re.findall(r"`([a-z0-9_]+)`", first)
    return names


def documented_flags(flag: str) -> set[str]:
    """Values of ``--config.<flag>=VALUE`` written in the documents (placeholders out)."""
    values = set()
    for path in DOCS:
        for value in re.findall(rf"--config\.{re.escape(flag)}=([A-Za-z0-9_,]+)",
                                path.read_text()):
            if not value.isupper() and value not in ("S", "R"):
                values.add(value)
    return values


def test_the_tables_are_read():
    assert {"cpt", "fp8_delayed", "nvfp4", "mx_float"} <= set(readme_presets())
    assert {"fp8_delayed", "mxfp6_gemm", "nvfp4_gemm"} <= set(formats_doc_presets())
    assert {"none", "constant", "cos_growth"} <= documented_flags("precision.schedule")


def test_every_documented_preset_is_a_quantizer_of_the_job(parse_only):
    from cpt_jax.quant_config import PRESETS

    names = sorted(set(readme_presets()) | set(formats_doc_presets()))
    assert set(names) <= set(PRESETS), set(names) - set(PRESETS)
    for name in names:
        code, err, config = parse_only(f"--config.precision.quantizer={name}")
        assert code == 0 and config.precision.quantizer == name, (name, err)


def test_every_preset_as_a_format_is_accepted_or_refused_in_one_line_naming_it(parse_only):
    from cpt_jax.quant_config import PRESETS

    for name in PRESETS:
        code, err, _ = parse_only(f"--config.precision.formats={name}")
        assert code == 0 or (code == 2 and err.count("\n") == 1 and name in err), (name, err)
    for value in documented_flags("precision.formats"):
        code, err, config = parse_only(f"--config.precision.formats={value}")
        assert code == 0, (value, err)


def test_fp8_delayed_is_a_run_of_its_own_not_a_format_of_a_schedule(parse_only):
    code, err, config = parse_only("--config.precision.formats=fp8_delayed")
    assert code == 2 and "amax history" in err and "precision.quantizer=fp8_delayed" in err, err
    from cpt_jax.providers import DelayedFP8Provider
    from cpt_jax.runner.builders import provider_from_config

    code, err, config = parse_only("--config.precision.quantizer=fp8_delayed")
    assert code == 0, err
    assert isinstance(provider_from_config(config.precision), DelayedFP8Provider)
    from cpt_jax.format_schedules import format_switch

    with pytest.raises(ValueError, match="amax history"):   # the library says so too
        format_switch(["fp8_delayed", "mxfp8"])


def test_every_documented_schedule_and_controller_is_accepted(parse_only):
    from cpt_jax import schedules

    names = set(schedules.SUITE) | {"constant", "critical_period", "none"}
    names |= documented_flags("precision.schedule")
    for name in sorted(names):
        code, err, config = parse_only(f"--config.precision.schedule={name}")
        assert code == 0 and config.precision.schedule == name, (name, err)
    row = next(line for line in read("README.md").splitlines()
               if line.startswith("| `cpt_jax.controllers`"))
    controllers = set(re.findall(r"`(on_[a-z_]+|online_[a-z_]+|final_phase)`", row))
    assert {"on_instability", "on_plateau", "online_range_test", "final_phase"} <= controllers
    for name in sorted(controllers | documented_flags("precision.controller")):
        code, err, _ = parse_only(f"--config.precision.controller={name}")
        assert code == 0, (name, err)


def _config_fields() -> dict[str, set[str]]:
    """``{config file: its flattened field names}`` of experiments/configs."""
    import importlib

    out = {}
    for path in sorted((ROOT / "experiments" / "configs").glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"experiments.configs.{path.stem}")
        config = module.get_config()
        flat = set()

        def walk(d, flat, prefix=""):
            for key, value in d.items():
                flat.add(prefix + key)
                if hasattr(value, "items"):
                    walk(value, flat, f"{prefix}{key}.")

        walk(config, flat)
        out[f"experiments/configs/{path.name}"] = flat
    return out


def test_every_documented_config_field_exists_and_parses(parse_only):
    fields = _config_fields()
    documented = set()
    for path in DOCS:
        documented |= set(re.findall(r"--config\.([a-z_][a-z0-9_.]*[a-z0-9_])", path.read_text()))
    documented -= {"no_such_field"}   # docs/reliability.md's example of a refused field
    missing = [f for f in documented if not any(f in flat for flat in fields.values())]
    assert not missing, f"documented --config fields no config defines: {missing}"
    for field in sorted(documented):
        config_file = next(name for name, flat in fields.items() if field in flat)
        import importlib
        module = importlib.import_module("experiments.configs." + pathlib.Path(config_file).stem)
        value = module.get_config()
        for part in field.split("."):
            value = value[part]
        if hasattr(value, "items") or isinstance(value, (tuple, list)):
            continue   # a subtree or a tuple: its own fields are walked
        text = str(value).lower() if isinstance(value, bool) else str(value)
        code, err, _ = parse_only(f"--config={config_file}", f"--config.{field}={text}")
        assert code == 0, (field, config_file, err)


DOCUMENTED_ERRORS = {
    # docs/reliability.md shows these refused, one line each (the bad-input table).
    ("augment", "maybe"), ("data_dir", "5"), ("nonfinite", "3"), ("num_steps", "1.5"),
    ("optimizer.learning_rate", "fast"), ("precision.keep_full_precision", "5"),
    ("precision.min_bits", "9"), ("no_such_field", "3")}
RUNTIME_EXAMPLES = {("optimizer.learning_rate", "1e30")}   # a non-finite step, not a flag error


def documented_examples() -> set[tuple[str, str]]:
    """Every ``--config.FIELD=VALUE`` written in the documents (placeholders out)."""
    pairs = set()
    for path in DOCS:
        for field, value in re.findall(r"--config\.([a-z_][a-z0-9_.]*[a-z0-9_])=([^\s`)|\]\\]+)",
                                       path.read_text()):
            value = value.rstrip(",.;:'\"")
            if value.isupper() or value.startswith("$") or value in ("S", "R", "B"):
                continue
            pairs.add((field, value))
    return pairs


def test_every_documented_config_example_parses_and_the_documented_errors_are_refused(
        parse_only):
    fields = _config_fields()
    examples = documented_examples()
    assert DOCUMENTED_ERRORS <= examples, DOCUMENTED_ERRORS - examples
    for field, value in sorted(examples - RUNTIME_EXAMPLES):   # data_dir: other machines' paths
        config_file = next((name for name, flat in fields.items() if field in flat),
                           "experiments/configs/default.py")
        code, err, _ = parse_only(f"--config={config_file}", f"--config.{field}={value}",
                                  validate=field != "data_dir" or value == "5")
        if (field, value) in DOCUMENTED_ERRORS:
            assert code == 2 and err.count("\n") == 1, (field, value, err)
        else:
            assert code == 0, (field, value, config_file, err)


# --------------------------------------------------------------------------- fp8_delayed

def test_fp8_delayed_scales_each_activation_from_its_amax_history():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import cpt_jax
    from cpt_jax.providers import DelayedFP8Provider
    from cpt_jax.quant_config import get_preset

    qmodel = cpt_jax.quantize_model(nn.Dense(4, use_bias=False),
                                    config=get_preset("fp8_delayed"),
                                    provider=DelayedFP8Provider())
    current = cpt_jax.quantize_model(nn.Dense(4, use_bias=False),
                                     config=get_preset("fp8_tensor"))
    big = jnp.array([[100.0, 1.0, -2.0, 0.3]])
    small = jnp.array([[1.0, 0.013, -0.2, 0.3]])
    v = qmodel.init(jax.random.key(0), big)
    @jax.jit  # one program per call (eagerly, each op of the provider compiles alone)
    def step(v, x):
        with cpt_jax.precision(8, 8):
            return qmodel.apply(v, x, mutable=["batch_stats"])

    _, mutated = step(v, big)
    hist = mutated["batch_stats"]["delayed_quant"]["input_history"]
    assert int(hist.count) == 1 and float(hist.hi[0]) == 100.0
    # The next step's input is scaled by the history's amax (100 / 448), not by its
    # own (1 / 448): 0.013 falls below E4M3's range at that scale.
    y_delayed, _ = step({**v, **mutated}, small)

    @jax.jit
    def current_step(params, x):
        with cpt_jax.precision(8, 8):
            return current.apply({"params": params}, x)

    y_current = current_step(v["params"], small)
    from cpt_jax.formats import ScaledFloat, quantize

    w = quantize(v["params"]["kernel"], 8, ScaledFloat("e4m3"))
    at_history = quantize(jnp.concatenate([small, big]), 8, ScaledFloat("e4m3"))[:1]
    assert jnp.allclose(y_delayed, at_history @ w, rtol=1e-5, atol=1e-6)  # jit vs eager GEMM
    assert jnp.allclose(y_current, quantize(small, 8, ScaledFloat("e4m3")) @ w, rtol=1e-5,
                        atol=1e-6)
    assert not jnp.allclose(y_delayed, y_current)


# --------------------------------------------------------------------------- slow

@pytest.mark.slow
def test_a_three_step_run_per_preset_differs_from_every_other():
    """3 steps of the digits MLP (two quantized Dense layers; the classifier fp32) per
    preset, bits 4..8: 24 presets, 24 different parameter hashes (no preset is an alias
    of another; ``fp8_delayed`` is not ``fp8_tensor``). On the CNN of the default
    config the ``*_gemm`` presets equal their fake-quant twins: its convolutions take
    the block-format path and its one Dense is the fp32 classifier (docs/formats.md)."""
    from cpt_jax.quant_config import PRESETS
    from cpt_jax.runner import job
    from experiments.configs import default

    hashes = {}
    for name in PRESETS:
        config = default.get_config()
        config.update(num_steps=3, model="mlp", eval_every=0, plots=False, tensorboard=False)
        config.model_kwargs.hidden = (160, 32)  # 160: two 128-tiles (the *_tile128 presets)
        config.precision.update(quantizer=name, num_cycles=1, min_bits=4)
        job.validate_config(config)
        run, state = job.build_run(config)
        batches = job.train_batches(run, 0)
        for _ in range(3):
            state, _ = run.train_step(state, next(batches))
        hashes[name] = job.params_sha256(state.params)
    groups: dict[str, set[str]] = {}
    for name, digest in hashes.items():
        groups.setdefault(digest, set()).add(name)
    same = [sorted(g) for g in groups.values() if len(g) > 1]
    assert not same, f"presets ending at identical parameters: {same}"


# --------------------------------------------------------------------------- errors

TINY = ("--config.num_steps=2", "--config.precision.num_cycles=1", "--config.eval_every=0",
        "--config.plots=false", "--config.tensorboard=false", "--progress=false")


def one_error_line(err: str) -> str:
    """The single ``error:`` line of `err` (asserting there is one and no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_checkpoint_that_cannot_be_written_is_one_oserror_naming_step_and_folder(tmp_path):
    from cpt_jax.runner import job
    from experiments import train
    from experiments.configs import default

    class Full:   # orbax's manager on a full disk: its own error around the OSError
        def save(self, step, state, meta):
            try:
                raise OSError(errno.ENOSPC, "No space left on device", "/x/y.tmp")
            except OSError as exc:
                raise RuntimeError("orbax: " + "x" * 400) from exc

    checkpoints = job.Checkpointer(str(tmp_path), 3, default.get_config())
    checkpoints._manager = Full()
    with pytest.raises(OSError) as info:
        checkpoints.save(7, None, [])
    assert info.value.errno == errno.ENOSPC
    message = str(train.os_error_message(info.value, str(tmp_path)))
    assert message == (f"no space left on device: cannot save the checkpoint of step 7 in "
                       f"{checkpoints.directory}; free some space or choose another folder "
                       f"(--workdir={tmp_path})"), message


def test_orbax_errors_during_a_save_are_held_back_and_tensorstore_codes_are_read():
    """A real full disk (a 120 kB tmpfs, by hand): orbax raised tensorstore's
    RESOURCE_EXHAUSTED "... No space left on device [os_error_code='28']" with no
    OSError in the chain, after logging two tracebacks (116 lines before the error)."""
    import logging as py_logging

    from absl import logging

    from cpt_jax.runner import checkpoint

    seen = []
    handler = py_logging.Handler()
    handler.emit = seen.append
    logger = logging.get_absl_logger()
    logger.addHandler(handler)

    def orbax_error():
        logger.handle(logger.makeRecord("absl", py_logging.ERROR, "/x/orbax/checkpoint/a.py",
                                        1, "save failed", (), None))
    try:
        with pytest.raises(ValueError):
            with checkpoint.orbax_errors_held():
                orbax_error()
                raise ValueError("RESOURCE_EXHAUSTED: Failed to write 72549 bytes: No space "
                                 "left on device [os_error_code='28']")
        assert seen == []
        orbax_error()
        assert len(seen) == 1
    finally:
        logger.removeHandler(handler)
    found = checkpoint.os_error_in(ValueError("... [os_error_code='28']"))
    assert found.errno == errno.ENOSPC


@pytest.mark.slow
def test_a_full_disk_while_checkpointing_is_one_line_naming_the_workdir(tmp_path, train_cli,
                                                                        monkeypatch):
    from cpt_jax.runner import checkpoint

    def full(self, step, state, meta=None):   # as orbax fails: its error wraps the OSError
        try:
            raise OSError(errno.ENOSPC, "No space left on device",
                          os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp"))
        except OSError as exc:
            raise ValueError("orbax: " + "x" * 400) from exc

    monkeypatch.setattr(checkpoint.CheckpointManager, "save", full)
    workdir = tmp_path / "run"
    code, err = train_cli(f"--workdir={workdir}", DEFAULT, *TINY)
    line = one_error_line(err)
    assert code == 2, err
    assert "no space left on device" in line.lower() and f"(--workdir={workdir})" in line, line
    assert "checkpoint of step 2" in line and len(line) < 300, line


@pytest.mark.parametrize("kind", ["file", "empty", "under_a_file"])
def test_a_bad_workdir_is_one_line_naming_the_flag_and_creates_nothing(tmp_path, parse_only,
                                                                      kind):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    workdir = {"file": str(a_file), "empty": "", "under_a_file": str(a_file / "run")}[kind]
    before = sorted(os.listdir(tmp_path))
    code, err, config = parse_only(f"--workdir={workdir}")
    line = one_error_line(err)
    assert code == 2 and config is None and "--workdir=" in line, err
    assert {"file": "existing file", "empty": "empty",
            "under_a_file": "is a file"}[kind] in line, line
    assert sorted(os.listdir(tmp_path)) == before


def test_a_missing_config_file_is_one_line_naming_it(parse_only):
    code, err, _ = parse_only("--config=experiments/configs/no_such.py")
    line = one_error_line(err)
    assert code == 2 and "--config=experiments/configs/no_such.py" in line, line
    assert "does not exist" in line and "config_config" not in line, line


@pytest.mark.parametrize("config", ["cifar10_resnet", "cora_gcn"])
def test_a_data_error_leaves_no_workdir_and_no_tfds_warning(tmp_path, train_cli, config):
    workdir = tmp_path / "run"
    code, err = train_cli(f"--workdir={workdir}", f"--config=experiments/configs/{config}.py",
                          "--config.data_dir=")
    line = one_error_line(err)
    assert code == 2 and "data_dir" in line, err
    assert not workdir.exists(), os.listdir(workdir)
    assert "dataset_info.json" not in err and "Variant folder" not in err, err


def test_no_usable_checkpoint_says_it_starts_from_step_0(tmp_path, monkeypatch):
    from absl import logging

    from cpt_jax.runner import job

    class Manager:   # two checkpoints, both unusable (restore_latest skipped them)
        def steps(self):
            return [2, 4]

    class Checkpoints:
        directory = str(tmp_path / "checkpoints")
        manager = Manager()

        def exists(self):
            return True

        def restore_latest(self, state):
            return None

    said = []
    monkeypatch.setattr(logging, "warning", lambda msg, *a: said.append(msg % a))
    state, records, resumed = job.restore_run(Checkpoints(), "fresh state")
    assert (state, records, resumed) == ("fresh state", [], None)
    assert said == [f"no usable checkpoint in {Checkpoints.directory}: starting from step 0"]


# --------------------------------------------------------------------------- help, docs

def test_help_lists_every_config_field_with_its_default_and_comment(capsys, train_cli):
    from experiments.config_help import flatten
    from experiments.configs import default

    for flag in ("--help", "--helpfull"):
        code, err = train_cli(flag)
        out = capsys.readouterr().out
        assert code == 0, (flag, err)
    lines = {line.split("=", 1)[0].strip(): line for line in out.splitlines()
             if line.startswith("  --config.")}
    rows = out.splitlines()
    for field, value in flatten(default.get_config()).items():
        key = f"--config.{field}"
        assert key in lines, key
        i = rows.index(lines[key])
        described = lines[key].split(None, 1)[1:] or rows[i + 1].split(None, 0)
        assert described and described[0].strip(), key   # a description on its line or the next
        shown = lines[key].split("=", 1)[1].split()[0]
        expected = str(value).lower() if isinstance(value, bool) else str(value).strip()
        assert shown.strip("'") == expected or (value == "" and shown == "''"), (key, shown)
    assert "--workdir" in out and "--extend" in out
    code, err = train_cli("--config=experiments/configs/ptb_lstm.py", "--help")
    out = capsys.readouterr().out
    assert code == 0 and "--config.seq_len=35" in out and "BPTT" in out, err


def test_help_says_what_checkpoint_every_0_does():
    """``checkpoint_every=0`` still saves the last step (`job.train_loop`; tested by
    test_runner's default-run test): its description says so."""
    from experiments.config_help import DEFAULT_FILE, field_comments

    text = field_comments(DEFAULT_FILE)["checkpoint_every"]
    assert "last step" in text and "only on" not in text, text


# --------------------------------------------------------------------------- curves.png

def test_curves_precision_panel_has_the_bits_of_every_step():
    from types import SimpleNamespace

    from cpt_jax import schedules
    from cpt_jax.runner import job

    fwd = schedules.cyclic("cos_growth", min_bits=3, max_bits=8, num_cycles=3, total_steps=30)
    run = SimpleNamespace(fwd_schedule=fwd, grad_schedule=schedules.constant(8),
                          controller=None)   # what precision_series reads

    records = [{"step": s, "bits": 0.0} for s in (10, 20, 30)]   # logged every 10 steps
    series = job.precision_series(run, records, 30)
    steps, bits = series["forward bits"]
    assert list(steps) == list(range(1, 31))
    assert list(bits) == list(schedules.schedule_values(fwd, 30))
    assert len(set(bits)) == 6   # 3..8, though the records only hold 3 steps
    assert list(series["backward bits"][1]) == [8.0] * 30

    controlled = SimpleNamespace(**{**vars(run), "controller": object()})
    realized = [{"step": 2, "bits_per_step": [3.0, 5.0]}, {"step": 4, "bits_per_step": [6.0, 8.0]}]
    steps, bits = job.precision_series(controlled, realized, 4)["forward bits (realized)"]
    assert list(steps) == [1, 2, 3, 4] and list(bits) == [3.0, 5.0, 6.0, 8.0]
