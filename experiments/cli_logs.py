"""What the command lines of experiments/ show of their libraries' logs.

absl's ``app.run`` shows INFO records, so every program printed jax's backend probe
on a machine without a TPU: ``Unable to initialize backend 'tpu': ... libtpu.so ...``.
That line is jax trying, unasked, each platform it knows (no ``JAX_PLATFORMS``) and
moving on; `quiet_backend_probe` drops it and nothing else. A platform that was asked
for (``JAX_PLATFORMS=tpu``) and fails still raises, and jax's own warning when it finds
an accelerator it cannot use ("A Google TPU may be present on this machine, but ...")
still shows: it is a WARNING.
"""
from __future__ import annotations

import logging

BACKEND_LOGGER = "jax._src.xla_bridge"
PROBE_MESSAGE = "Unable to initialize backend"


class _NoBackendProbe(logging.Filter):
    """Drops jax's INFO record of a backend it probed unasked and could not start."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: A003 - logging API
        return not (record.levelno < logging.WARNING
                    and str(record.msg).startswith(PROBE_MESSAGE))


_FILTER = _NoBackendProbe()


def quiet_backend_probe() -> None:
    """Install the filter on jax's backend logger (once: again changes nothing).

    Example:
      >>> quiet_backend_probe()
      >>> log = logging.getLogger(BACKEND_LOGGER)
      >>> probe = log.makeRecord(BACKEND_LOGGER, logging.INFO, "", 0,
      ...                        "Unable to initialize backend 'tpu': no libtpu.so", (), None)
      >>> log.filter(probe), log.filter(log.makeRecord(
      ...     BACKEND_LOGGER, logging.WARNING, "", 0, "A Google TPU may be present", (), None))
      (False, True)
    """
    logger = logging.getLogger(BACKEND_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
