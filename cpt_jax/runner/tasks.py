"""The one task registry: ``config.dataset`` -> the builder of its `Task`.

Image classification (`cpt_jax.runner.image_tasks`), node classification and
language (`cpt_jax.runner.domain_tasks`) are listed here explicitly; a user adds a
dataset with `register_task`.
"""
from __future__ import annotations

from cpt_jax import data as image_data
from cpt_jax.runner import domain_tasks, image_tasks
from cpt_jax.runner.task import Task, TaskBuilder

TASK_BUILDERS: dict[str, TaskBuilder] = {**image_tasks.BUILDERS, **domain_tasks.BUILDERS}
"""Dataset name -> ``builder(config) -> Task``."""


def register_task(*datasets: str):
    """Decorator: register a ``builder(config) -> Task`` for the given dataset names.

    Example:
      >>> @register_task("my_dataset")
      ... def my_task(config):
      ...     ...
      >>> "my_dataset" in available_datasets()
      True
      >>> _ = TASK_BUILDERS.pop("my_dataset")
    """
    def wrap(builder: TaskBuilder) -> TaskBuilder:
        for name in datasets:
            TASK_BUILDERS[name] = builder
        return builder
    return wrap


def available_datasets() -> tuple:
    """Names accepted by ``config.dataset``."""
    return tuple(sorted(TASK_BUILDERS))


def build_task(config) -> Task:
    """The `Task` for ``config.dataset`` (ValueError listing the valid names)."""
    name = config.dataset
    if name not in TASK_BUILDERS:
        raise ValueError(
            f"config.dataset={name!r} is unknown; choose one of {sorted(TASK_BUILDERS)}")
    if config.get("input_pipeline", "device") == "grain" and (
            name not in image_data.IMAGE_DATASETS):
        raise ValueError(f"config.input_pipeline='grain' streams image datasets "
                         f"{image_data.IMAGE_DATASETS}; {name!r} uses 'device'")
    return TASK_BUILDERS[name](config)


__all__ = ["TASK_BUILDERS", "available_datasets", "build_task", "register_task"]
