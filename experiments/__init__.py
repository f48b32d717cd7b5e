"""The job beside the library: ``python -m experiments.NAME`` (train, export, compare,
the studies). Every program here drops jax's backend-probe INFO line
(`experiments.cli_logs`)."""
from experiments.cli_logs import quiet_backend_probe

quiet_backend_probe()
