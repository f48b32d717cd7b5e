"""The registries (issue 42): a preset is one `register_preset` call, and everything that
lists presets reads the registry (PRESETS' docstring, the CLI's validation and
``--help``); the hand-written tables (docs/formats.md's preset table) are checked
against it both ways."""
from __future__ import annotations

import pathlib
import re

import pytest

import cpt_jax
from cpt_jax import quant_config
from cpt_jax.registry import Registry
from cpt_jax.runner.validation import validate_config
from experiments import config_help
from experiments.configs import default

ROOT = pathlib.Path(__file__).resolve().parents[1]


def formats_doc_presets() -> set[str]:
    """The names in the first column of docs/formats.md's preset table."""
    text = (ROOT / "docs" / "formats.md").read_text()
    table = text.split("| preset | weights |", 1)[1].split("\n\n", 1)[0]
    return {name for line in table.splitlines()[2:]
            for name in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1])}


@pytest.fixture
def user_preset():
    """A preset registered for one test, then removed."""
    config = cpt_jax.QuantConfig(weight=cpt_jax.TensorQuant(cpt_jax.SymmetricInt()),
                                 activation=None, error=None)
    cpt_jax.register_preset("weights_only_test", config, "Symmetric weights, fp32 else.")
    yield "weights_only_test", config
    quant_config.unregister_preset("weights_only_test")


def test_a_registry_keeps_order_refuses_clashes_and_bad_names():
    r = Registry("thing")
    r.register("b", 1, "B.")
    r.register("a", 2, "A.")
    assert r.names() == ("b", "a") and list(r.view()) == ["b", "a"]
    r.register("b", 1, "B.")                      # the same again (a module imported twice)
    with pytest.raises(ValueError, match="'b' is already registered.*replace=True"):
        r.register("b", 3, "B.")
    assert r.register("b", 3, "Bee.", replace=True) == 3 and r.doc("b") == "Bee."
    with pytest.raises(ValueError, match=r"must match \[a-z\]"):
        r.register("Has-Dash", 1, "x")
    with pytest.raises(ValueError, match="doc must be a non-empty string"):
        r.register("c", 1, "  ")
    r.unregister("a")
    with pytest.raises(ValueError, match=r"unknown thing 'a'; known: \['b'\]"):
        r.get("a")


def test_presets_are_a_read_only_view_whose_docstring_lists_every_one():
    doc = cpt_jax.PRESETS.__doc__
    for name in cpt_jax.PRESETS:
        assert f"``{name}``\n    {quant_config.preset_doc(name)}" in doc
    with pytest.raises(TypeError):
        cpt_jax.PRESETS["x"] = cpt_jax.CPT_CONFIG   # type: ignore[index]
    assert cpt_jax.PRESETS["cpt"] is cpt_jax.CPT_CONFIG


def test_register_preset_checks_its_arguments():
    with pytest.raises(ValueError, match="config must be a QuantConfig"):
        cpt_jax.register_preset("nope", "mxfp8", "A string is not a recipe.")
    with pytest.raises(ValueError, match="'cpt' is already registered"):
        cpt_jax.register_preset("cpt", cpt_jax.get_preset("int8"), "Not CPT.")


def test_the_formats_doc_table_names_every_registered_preset_and_no_other():
    documented = formats_doc_presets()
    assert documented == set(cpt_jax.PRESETS), (
        f"registered, not in docs/formats.md's table: {sorted(set(cpt_jax.PRESETS) - documented)}; "
        f"in the table, not registered: {sorted(documented - set(cpt_jax.PRESETS))}")


def test_the_readme_row_names_registered_presets_and_points_to_the_table():
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| `cpt_jax.PRESETS`"))
    assert "register_preset" in row and "docs/formats.md" in row
    named = set(re.findall(r"`([a-z0-9_]+)`", row.split("):", 1)[1]))
    assert named and named <= set(cpt_jax.PRESETS), named - set(cpt_jax.PRESETS)


def test_the_job_validates_and_lists_what_is_registered(user_preset):
    name, _ = user_preset
    config = default.get_config()
    config.precision.quantizer = name
    validate_config(config, device_count=1)
    line = next(line for line in config_help.config_help("experiments/configs/default.py")
                .splitlines() if "--config.precision.quantizer=" in line)
    assert all(f" {n} " in f" {line} " for n in cpt_jax.PRESETS), line
    quant_config.unregister_preset(name)
    with pytest.raises(ValueError, match=f"config.precision.quantizer='{name}' is unknown"):
        validate_config(config, device_count=1)
    cpt_jax.register_preset(name, user_preset[1], "Symmetric weights, fp32 else.")


def test_running_ranges_are_offered_for_the_presets_that_take_them():
    from cpt_jax.runner.validation import running_range_quantizers

    config = default.get_config()
    config.precision.activation_range = "running"
    config.precision.quantizer = "mxfp8"
    with pytest.raises(ValueError, match=r"needs config.precision.quantizer in \('cpt', "
                                         r"'symmetric'\), got 'mxfp8'"):
        validate_config(config, device_count=1)
    assert running_range_quantizers() == ("cpt", "symmetric")


# --------------------------------------------------------------------------- controllers

def adaptive_doc_fields() -> set[str]:
    """The fields in the first column of docs/adaptive.md's main-job field table."""
    text = (ROOT / "docs" / "adaptive.md").read_text()
    table = text.split("| field | used by | meaning |", 1)[1].split("\n\n", 1)[0]
    return {name for line in table.splitlines()[2:]
            for name in re.findall(r"`(controller_[a-z0-9_]+)`", line.split("|")[1])}


@pytest.fixture
def user_controller():
    """A controller registered for one test (the base, raised by controller_lift bits)."""
    from cpt_jax import controllers as ctl

    def build(ctx):
        lift = ctx.config["controller_lift"]

        def update(state, stats, step):
            return ctl.Bits(ctl.adjust(ctx.base, step, raise_by=lift)[0],
                            ctl.error_bits(ctx.error_base, step)), state

        return ctl.PrecisionController(init=lambda: (), update=update)

    cpt_jax.register_controller(
        "lift_test", build, doc="The base raised by controller_lift bits.",
        fields={"controller_lift": ctl.ControllerField(1, "bits added to the base", low=0)})
    yield "lift_test"
    ctl.unregister_controller("lift_test")


def test_the_adaptive_doc_table_names_every_registered_field_and_no_other():
    from cpt_jax.controllers import controller_fields

    documented = adaptive_doc_fields()
    assert documented == set(controller_fields()), (
        f"registered, not in docs/adaptive.md's table: "
        f"{sorted(set(controller_fields()) - documented)}; in the table, not registered: "
        f"{sorted(documented - set(controller_fields()))}")


def test_the_job_offers_validates_and_builds_a_registered_controller(user_controller):
    from cpt_jax.runner import builders

    config = default.get_config()       # built after the registration: the field is there
    assert config.precision.controller_lift == 1
    config.precision.controller = user_controller
    validate_config(config, device_count=1)
    config.precision.controller_lift = -1
    with pytest.raises(ValueError, match="config.precision.controller_lift=-1 must be an integer"):
        validate_config(config, device_count=1)
    config.precision.controller_lift = 3
    p = config.precision
    c = builders.controller_from_config(p, builders.precision_schedule_from_config(p, 10), None)
    bits, _ = c.update(c.init(), None, 0)
    assert float(bits.forward) == float(builders.precision_schedule_from_config(p, 10)(0)) + 3
    text = config_help.config_help("experiments/configs/default.py")
    assert "lift_test" in next(line for line in text.splitlines()
                               if "--config.precision.controller=" in line)
    assert "lift_test: bits added to the base" in text


def test_register_controller_refuses_clashes_and_bad_fields():
    from cpt_jax import controllers as ctl

    build = ctl.get_controller("on_instability").build
    with pytest.raises(ValueError, match="'controller_hold' has default 10 already"):
        ctl.register_controller("clash", build, doc="x",
                                fields={"controller_hold": ctl.ControllerField(3, "steps")})
    with pytest.raises(ValueError, match=r"must match controller_\[a-z0-9_\]\+"):
        ctl.register_controller("bad", build, doc="x", fields={"min_bits": ctl.ControllerField(1, "b")})
    with pytest.raises(ValueError, match="'none' is the choice without a controller"):
        ctl.register_controller("none", build, doc="x")
    with pytest.raises(ValueError, match="give build"):
        ctl.register_controller("empty", doc="x")
    assert "clash" not in ctl.CONTROLLERS and "bad" not in ctl.CONTROLLERS


def test_only_the_chosen_controllers_fields_are_validated():
    config = default.get_config()
    config.precision.controller = "on_instability"
    config.precision.controller_window = 0          # online_range_test's field, unused here
    validate_config(config, device_count=1)
    config.precision.controller = "online_range_test"
    with pytest.raises(ValueError, match="config.precision.controller_window=0"):
        validate_config(config, device_count=1)


# --------------------------------------------------------------------------- extensions

def test_every_extension_module_is_imported_by_import_cpt_jax():
    import sys

    from cpt_jax import extensions

    found = extensions.extension_modules()
    assert extensions.LOADED == found
    assert all(name in sys.modules for name in found)
    on_disk = sorted(p.stem for p in (ROOT / "cpt_jax" / "extensions").glob("*.py")
                     if not p.stem.startswith("_"))
    assert [name.rsplit(".", 1)[1] for name in found] == on_disk
