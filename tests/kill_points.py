"""Run ``experiments.train`` (its real CLI) with a deterministic kill point, for the tests.

    CPT_TEST_KILL=POINT:STEP python tests/kill_points.py --workdir=... --config=...

POINT is where the process signals itself, so a test knows it died exactly there:

=================  =======================================================================
``term``           SIGTERM after step STEP's periodic actions (a preemption: checkpoint,
                   summary, exit code 3)
``kill``           SIGKILL after step STEP's periodic actions (mid-training)
``kill_in_save``   SIGKILL inside orbax's save of step STEP, when its temporary folder is
                   complete and about to be renamed into place (a torn orbax save)
``kill_manifest``  SIGKILL after orbax committed step STEP, before cpt_manifest.json (a
                   checkpoint without its manifest)
=================  =======================================================================

Without CPT_TEST_KILL it is the plain CLI. Not collected by pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import os
import runpy
import signal
import sys


def _die(sig: int) -> None:
    os.kill(os.getpid(), sig)
    if sig == signal.SIGKILL:  # pragma: no cover - never returns
        raise SystemExit("SIGKILL did not kill")


def _after_step(at: int, sig: int) -> None:
    from cpt_jax.runner import loop  # where train_steps looks run_actions up

    run_actions = loop.run_actions

    def hooked(actions, step, state, metrics):
        run_actions(actions, step, state, metrics)
        if step == at:
            _die(sig)

    loop.run_actions = hooked


def _in_orbax_commit(at: int) -> None:
    rename = os.rename

    def hooked(src, dst, *args, **kwargs):
        name = os.path.basename(os.fspath(src))
        if "orbax-checkpoint-tmp" in name and name.split(".")[0] == str(at):
            _die(signal.SIGKILL)
        return rename(src, dst, *args, **kwargs)

    os.rename = hooked


def _before_manifest(at: int) -> None:
    from cpt_jax.runner import checkpoint_manager  # where CheckpointManager.save looks it up

    write_manifest = checkpoint_manager.write_manifest

    def hooked(step_dir, step):
        if int(step) == at:
            _die(signal.SIGKILL)
        return write_manifest(step_dir, step)

    checkpoint_manager.write_manifest = hooked


def install(spec: str) -> None:
    """Install the kill point ``POINT:STEP`` (see the module docstring)."""
    point, step = spec.split(":")
    at = int(step)
    if point == "term":
        _after_step(at, signal.SIGTERM)
    elif point == "kill":
        _after_step(at, signal.SIGKILL)
    elif point == "kill_in_save":
        _in_orbax_commit(at)
    elif point == "kill_manifest":
        _before_manifest(at)
    else:
        raise SystemExit(f"unknown kill point {point!r}")


if __name__ == "__main__":
    if os.environ.get("CPT_TEST_KILL"):
        install(os.environ["CPT_TEST_KILL"])
    sys.argv = ["experiments.train"] + sys.argv[1:]
    runpy.run_module("experiments.train", run_name="__main__", alter_sys=True)
