"""Checkpoints that make a run resumable bit for bit: the names of the four modules, in one place.

Every name this module had still imports from here; each lives in the module of its
idea:

=========================  ==========================================================
module                     what
=========================  ==========================================================
``checkpoint_files``       saveable trees (`to_saveable`, `from_saveable`), the
                           sha256 manifest (`write_manifest`, `verify_manifest`),
                           `structure_mismatch`
``orbax_logs``             orbax's INFO chatter dropped, its errors held back
                           (`orbax_errors_held`), the OSError under them
                           (`os_error_in`)
``checkpoint_manager``     the storage: `CheckpointManager` (orbax save/restore,
                           verified; torn or corrupt ones moved to ``invalid/``)
``resume``                 the run's: `Checkpointer`, `check_resume_compatible`,
                           `refuse_other_runs`, `restore_run`, `resume_segments`
=========================  ==========================================================

To replace a function for a test, patch it in the module that calls it (e.g.
``checkpoint_manager.write_manifest``, which `CheckpointManager.save` looks up):
rebinding a name here changes nothing for its callers.
"""
from cpt_jax.runner.checkpoint_files import (  # noqa: F401 - re-exported
    MANIFEST_NAME,
    from_saveable,
    structure_mismatch,
    to_saveable,
    verify_manifest,
    write_manifest,
)
from cpt_jax.runner.checkpoint_manager import (  # noqa: F401 - re-exported
    DEFAULT_KEEP,
    INVALID_DIR,
    CheckpointManager,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    Restored,
)
from cpt_jax.runner.orbax_logs import (  # noqa: F401 - re-exported
    orbax_errors_held,
    os_error_in,
    quiet_orbax_logs,
)
from cpt_jax.runner.resume import (  # noqa: F401 - re-exported
    CHECKPOINT_SUBDIR,
    FIELDS_ADDED,
    INACTIVE_WITHOUT,
    OPERATIONAL_FIELDS,
    Checkpointer,
    Segments,
    check_resume_compatible,
    config_to_json,
    refuse_other_runs,
    restore_run,
    resume_segments,
)
