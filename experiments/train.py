"""The main job: train a (cyclic) low-precision model from an ml_collections config.

    python -m experiments.train --workdir=DIR --config=experiments/configs/default.py \
        [--config.precision.schedule=cos_growth] [--config.num_steps=...] ...

Writes metrics.jsonl, summary.json, plots, TensorBoard events and checkpoints (the
final state always; every N steps with ``--config.checkpoint_every=N``) to DIR.
Rerunning the same command with a DIR that holds a checkpoint resumes from it (see
docs/reliability.md); a run that already finished trains nothing and keeps its
summary.json (printed again, with a warning naming --extend). To continue a finished
or interrupted run to a new length:

    python -m experiments.train --workdir=DIR --config=... --config.num_steps=N2 --extend

(every schedule is rebuilt for N2 steps; ``summary.json`` records ``extended_from_step``).

``--help`` lists the flags and every ``--config.FIELD`` of the config (``--config=FILE``,
default experiments/configs/default.py) with its default and the config file's comment.

Exit codes:
  0  finished (or ``--help``);
  1  stopped at a non-finite loss/gradient (``--config.nonfinite=stop``): one line
     ``error: ...`` naming the step, the bits and the layer;
  2  user error (bad flag or config value, missing config file, unusable --workdir,
     missing or corrupt data file, disk full): one line ``error: ...`` naming the flag
     or file and what was expected, no traceback, and nothing created in --workdir;
  3  stopped by SIGTERM/SIGINT after saving a checkpoint: rerun to resume.
"""
from __future__ import annotations

import errno
import json
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, checkpoints and plots.")
config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file.",
                                lock_config=True)
flags.mark_flags_as_required(["workdir", "config"])
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_EXTEND = flags.DEFINE_bool(
    "extend", False, "Continue the run in --workdir (finished or interrupted) from its last "
    "checkpoint to a new --config.num_steps, every schedule rebuilt for the new length.")

EXIT_NONFINITE = 1
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 3


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def user_error(exc: BaseException, code: int = EXIT_USER_ERROR) -> None:
    """Print ``error: <message>`` on one line to stderr and exit with `code` (the
    traceback is logged at debug level: ``--verbosity=1`` shows it)."""
    logging.debug("%s", type(exc).__name__, exc_info=exc)
    print(f"error: {_one_line(exc)}", file=sys.stderr)
    sys.exit(code)


# What a --config.FIELD=VALUE of the wrong type needed, from the parser's own message.
_EXPECTED_BY_PARSER = (("invalid literal for int()", "an integer"),
                       ("could not convert string to float", "a number"),
                       ("Non-boolean argument", "true or false"))


def flag_error(exc: Exception) -> Exception:
    """`exc` with what the value should have been, for a wrong-typed ``--config.FIELD``.

    Example:
      >>> str(flag_error(ValueError("flag --config.seed=x: invalid literal for int() "
      ...                           "with base 10: 'x'")))
      "flag --config.seed=x: invalid literal for int() with base 10: 'x' (expected an integer)"
    """
    text = str(exc)
    for needle, expected in _EXPECTED_BY_PARSER:
        if needle in text:
            return ValueError(f"{text} (expected {expected})")
    return exc


HELP_FLAGS = ("-h", "-?", "--help", "-help", "--helpfull", "-helpfull", "--helpshort",
              "-helpshort")
DEFAULT_CONFIG = "experiments/configs/default.py"


def _flag_value(argv, name: str) -> str | None:
    """The value of ``--name=V`` / ``--name V`` in `argv` (the last one), or None."""
    value = None
    for i, arg in enumerate(argv[1:], 1):
        if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith((f"--{name}=", f"-{name}=")):
            value = arg.split("=", 1)[1]
    return value


def check_config_file(argv) -> None:
    """One line naming ``--config`` when its file does not exist (before absl's parser,
    whose message is about "config_config")."""
    value = _flag_value(argv, "config")
    if value is None:
        return
    path = value.split(":", 1)[0]
    if not path:
        user_error(ValueError("--config='' is empty: expected a config file, e.g. "
                              f"--config={DEFAULT_CONFIG}"))
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        user_error(ValueError(f"--config={value}: the file {path!r} {what}; expected a "
                              f"Python config file defining get_config(), e.g. "
                              f"--config={DEFAULT_CONFIG}"))


def print_help(argv) -> None:
    """``--help``: usage, this program's flags and the config's fields (to stdout)."""
    from experiments import config_help

    value = _flag_value(argv, "config") or DEFAULT_CONFIG
    print((__doc__ or "").split("Exit codes:", 1)[0].rstrip())
    print("\nflags:")
    print(FLAGS.module_help(sys.modules[__name__].__name__ if __name__ != "__main__"
                            else sys.argv[0]) or FLAGS.main_module_help())
    print()
    try:
        print(config_help.config_help(value))
    except Exception as exc:  # noqa: BLE001 - help must not fail on a bad --config
        print(f"(the fields of --config={value} cannot be listed: {_one_line(exc)})")


def missing_field(exc: KeyError) -> tuple[str, str | None]:
    r"""``(field, suggestion)`` of ml_collections' KeyError for a field the config lacks:
    its message is the quoted name, then ``\nDid you mean "x" instead of "y"?`` when a
    field is close.

    Example:
      >>> missing_field(KeyError("'num_stepz'\nDid you mean \"num_steps\" instead of "
      ...                        "\"num_stepz\"?"))
      ('num_stepz', 'num_steps')
      >>> missing_field(KeyError("no_such_field"))
      ('no_such_field', None)
    """
    text = str(exc.args[0]) if exc.args else ""
    first, _, rest = text.partition("\n")
    suggestion = re.search(r'Did you mean "([^"]+)"', rest)
    return first.strip("'\""), suggestion.group(1) if suggestion else None


def config_lookup_error(exc: KeyError | AttributeError, argv) -> Exception:
    """One message for ml_collections' lookup errors while parsing: an override of a
    field the config lacks (a KeyError, possibly inside an AttributeError), named as
    the flag given, with its "did you mean" once; a config file without
    ``get_config()``, named by its path."""
    inner = exc.args[0] if exc.args and isinstance(exc.args[0], KeyError) else exc
    if not isinstance(inner, KeyError):
        if "get_config" in str(exc):
            path = (_flag_value(argv, "config") or "").split(":", 1)[0]
            return ValueError(f"--config={path}: the file defines no get_config(); a config "
                              f"file defines get_config() returning an ml_collections "
                              f"ConfigDict, e.g. {DEFAULT_CONFIG}")
        return exc
    key, suggestion = missing_field(inner)
    given = [a for a in argv[1:] if a.startswith("--config.")
             and key in a.split("=")[0].split(".")]
    where = given[0].split("=")[0] if given else f"--config.{key}"
    hint = ""
    if suggestion:
        hint = f"; did you mean {where.rsplit('.', 1)[0]}.{suggestion}?"
    return ValueError(f"{where}: the config has no field {key!r}{hint} (see the config "
                      f"file for the fields it defines, or --help)")


def parse_flags(argv):
    """absl flag parsing whose errors (unknown ``--config.field``, bad or wrong-typed
    value, missing flag, missing or unreadable config file) are one ``error: ...`` line
    and exit code 2; ``--help`` prints the flags and the config's fields, exit 0."""
    if any(arg in HELP_FLAGS for arg in argv[1:]):
        print_help(argv)
        sys.exit(0)
    check_config_file(argv)
    # ml_collections loads every --config file as the module "config_config" with
    # load_module, which re-executes into a module of that name already in sys.modules:
    # a second config file in one process (a notebook, a test) kept the first one's
    # get_config when it defined none. Each parse loads its file afresh.
    sys.modules.pop("config_config", None)
    try:
        return FLAGS(argv)
    except flags.Error as exc:
        user_error(flag_error(exc))
    except (KeyError, AttributeError) as exc:
        user_error(config_lookup_error(exc, argv))
    except (ValueError, TypeError, OSError, SyntaxError) as exc:
        # ml_collections raises these for bad override values and bad config files.
        user_error(exc)


def check_workdir(workdir) -> None:
    """One line naming ``--workdir`` unless it is (or can become) a writable folder:
    checked before anything is created."""
    from cpt_jax.runner.validation import check_workdir as check

    try:
        check(workdir, field="--workdir")
    except ValueError as exc:
        user_error(exc)


def os_error_message(exc: OSError, workdir: str) -> Exception:
    """`exc` as one line: a full disk says so first and names --workdir; another error
    about a file inside the workdir names it too; the rest (a data file) as they are."""
    inner = exc
    seen = set()
    while inner is not None and id(inner) not in seen:  # the OSError orbax wrapped
        seen.add(id(inner))
        if isinstance(inner, OSError) and inner.errno is not None:
            break
        inner = inner.__cause__ or inner.__context__
    inner = inner if isinstance(inner, OSError) else exc
    where = f" (--workdir={workdir})"
    if inner.errno == errno.ENOSPC or "no space left" in str(exc).lower():
        said = " ".join(str(inner.strerror or "").split())
        if not said.lower().startswith("no space left on device: "):  # not the job's own
            path = inner.filename or getattr(exc, "filename", None)
            said = "no space left on device" + (f" writing {path}" if path else "")
        return OSError(f"{said}; free some space or choose another folder{where}")
    path = inner.filename or getattr(exc, "filename", None)
    text = _one_line(exc)
    inside = path and os.path.abspath(str(path)).startswith(os.path.abspath(workdir))
    return OSError(text + where if inside and "--workdir" not in text else text)


def main(argv):
    if len(argv) > 1:
        user_error(app.UsageError(f"unexpected arguments: {argv[1:]}"))
    check_workdir(_WORKDIR.value)
    from cpt_jax.distributed import initialize_from_environment
    initialize_from_environment()
    from cpt_jax.runner.job import NonFiniteError, train_and_evaluate

    try:
        summary = train_and_evaluate(FLAGS.config, _WORKDIR.value, progress=_PROGRESS.value,
                                     extend=_EXTEND.value)
    except NonFiniteError as exc:
        user_error(exc, EXIT_NONFINITE)
    except ValueError as exc:  # DatasetUnavailableError too
        user_error(exc)
    except OSError as exc:  # FileNotFoundError, a full disk, ...
        user_error(os_error_message(exc, _WORKDIR.value))
    keys = [k for k in summary if k.startswith("final_")] + [
        "relative_cost_fp32", "relative_cost_static8", "mean_bits", "num_compiles", "steps",
        "wall_time_s", "skipped_steps", "interrupted", "resumed_from_step",
        "extended_from_step", "params_sha256"]
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=1))
    if summary.get("interrupted"):
        logging.warning("interrupted at step %s; rerun the same command to resume",
                        summary.get("steps"))
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
