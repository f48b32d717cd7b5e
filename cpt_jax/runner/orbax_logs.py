"""What a run shows of orbax: its INFO chatter dropped, its errors held back, the OSError under them.

Orbax logs every save at INFO level and, when one fails, an ERROR record with its
traceback, then raises its own exception around the real cause (a full disk, a folder
gone read-only). The run reports such a failure once, as one line:
`quiet_orbax_logs` drops the INFO records (warnings still show), `orbax_errors_held`
keeps the ERROR records back while a save runs (logged at debug level if it fails),
and `os_error_in` finds the `OSError` that orbax's exception wraps.
"""
from __future__ import annotations

import contextlib
import logging as py_logging
import os
import re

from absl import logging


class _QuietOrbax:
    """A `logging.Filter` dropping orbax's INFO chatter (its warnings still show)."""

    def filter(self, record) -> bool:  # noqa: A003 - logging API
        return record.levelno >= py_logging.WARNING or "orbax" not in record.pathname


_QUIET_ORBAX = _QuietOrbax()


def quiet_orbax_logs() -> None:
    """Install the filter that drops orbax's records below WARNING on absl's logger and
    handler (once: installing it again changes nothing).

    A record passes iff ``record.levelno >= WARNING or "orbax" not in record.pathname``.
    """
    for target in (logging.get_absl_logger(), logging.get_absl_handler()):
        if _QUIET_ORBAX not in target.filters:
            target.addFilter(_QUIET_ORBAX)


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The first `OSError` with an errno in `exc`'s chain (``__cause__``,
    ``__context__``), or one made from tensorstore's ``[os_error_code='N']`` in a
    message of the chain: what orbax's wrapped failure really was; None if neither.

    Example:
      >>> import errno
      >>> try:
      ...     try:
      ...         raise OSError(errno.ENOSPC, "No space left on device")
      ...     except OSError as e:
      ...         raise ValueError("orbax: save failed") from e
      ... except ValueError as e:
      ...     os_error_in(e).errno == errno.ENOSPC
      True
      >>> os_error_in(ValueError("RESOURCE_EXHAUSTED: ... No space left on device "
      ...                        "[os_error_code='28']")).strerror
      'No space left on device'
    """
    seen, chain = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for link in chain:  # tensorstore (orbax's OCDBT writer): "... [os_error_code='28']"
        code = re.search(r"os_error_code='(\d+)'", str(link))
        if code:
            number = int(code.group(1))
            return OSError(number, os.strerror(number))
    return None


class _HeldOrbaxErrors:
    """A `logging.Filter` that holds back orbax's error records (with their tracebacks):
    a failed save is reported once, as one line, by the caller."""

    def __init__(self):
        self.held: list = []

    def filter(self, record) -> bool:  # noqa: A003 - logging API
        if "orbax" in record.pathname and record.levelno >= py_logging.ERROR:
            self.held.append(record)
            return False
        return True


@contextlib.contextmanager
def orbax_errors_held():
    """While inside, orbax's ERROR records are not shown (logged at debug level if the
    block fails: ``--verbosity=1`` shows them)."""
    holder = _HeldOrbaxErrors()
    targets = [logging.get_absl_logger(), logging.get_absl_handler(),
               *py_logging.getLogger().handlers]
    for target in targets:
        target.addFilter(holder)
    try:
        yield holder
    except BaseException:
        for record in holder.held:
            logging.debug("orbax: %s", record.getMessage())
        raise
    finally:
        for target in targets:
            target.removeFilter(holder)

