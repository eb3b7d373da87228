"""Every exception hpclb raises on purpose, each with the exit status ``hpclb`` gives it.

The command line maps an exception to its exit status in one place (:func:`hpclb.cli.common.
exit_status`) from two class attributes:

- ``exit_code``: 1 (a failure), 2 (bad input: fix the recipe, flags or files and run again),
  3 (the run diverged: not requeued), 75 (``EX_TEMPFAIL``, preempted: the job templates
  requeue on it);
- ``agreed``: True when every rank raises the exception together (decided by a collective or
  from inputs all ranks share), so rank 0 alone prints it and no rank needs ``MPI_Abort``;
  False when one rank may raise it alone, so that rank prints it and aborts the job.

Any other exception is a failure on the rank that raised it (exit 1, ``MPI_Abort``).
"""
from __future__ import annotations

import errno
from pathlib import Path

__all__ = [
    "EXIT_FAILURE", "EXIT_USAGE", "DIVERGED_EXIT_CODE", "PREEMPTED_EXIT_CODE",
    "HpclbError", "ConfigError", "RecipeWarning", "DataError", "CheckpointError", "JobError",
    "ModelMismatchError", "AgreedFailure", "RunFinished", "NonFiniteError", "Preempted", "Diverged",
    "KernelCompileError", "MissingExtraError", "WarmupTooLong", "BudgetTooLarge", "DiskFull",
    "DISK_FULL_ERRNOS", "disk_full_message",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2            # bad input: the message says what to change
DIVERGED_EXIT_CODE = 3    # the run diverged (non-finite loss/gradient); not requeued
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; the job templates requeue on it
#: the errors of a write that found the disk (or the user's quota) full
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class HpclbError(Exception):
    """Base of hpclb's own exceptions: ``exit_code`` and ``agreed`` as in the module docstring."""

    exit_code = EXIT_FAILURE
    agreed = False


class ConfigError(HpclbError, ValueError):
    """An invalid experiment recipe or command-line setting (checked on every rank alike)."""

    exit_code = EXIT_USAGE
    agreed = True


class RecipeWarning(UserWarning):
    """A recipe or command-line value that is valid but outside its sensible range."""


class DataError(HpclbError, RuntimeError):
    """A data file is missing, truncated or not what its name says."""


class CheckpointError(HpclbError, RuntimeError):
    """A checkpoint cannot be read or written, or does not belong to this run."""


def disk_full_message(path, error: OSError, what: str, kept: str) -> str:
    """The one message of a write stopped by a full disk (:data:`DISK_FULL_ERRNOS`): the file
    ``path``, ``what`` was written, the ``error``, what is still valid (``kept``) and the fix."""
    return (f"{path}: disk full while writing {what} ({error}); {kept}; free space under "
            f"{Path(path).parent} (or write elsewhere) and run the command again")


class DiskFull(HpclbError, OSError):
    """A write of ``path`` stopped by a full disk or quota (:data:`DISK_FULL_ERRNOS`, kept as
    ``errno``); the message (:func:`disk_full_message`) names the file, what is still valid
    (``kept``) and the fix."""

    def __init__(self, path, error: OSError, kept: str, what: str = "it"):
        super().__init__(disk_full_message(path, error, what, kept))
        self.errno = error.errno


class JobError(HpclbError, ValueError):
    """A job that cannot be rendered as asked; the message says what to change."""

    exit_code = EXIT_USAGE


class ModelMismatchError(HpclbError, RuntimeError):
    """Ranks hold different models (names, shapes or dtypes) or different sync settings
    (found by an allgather, so every rank raises it)."""

    exit_code = EXIT_USAGE
    agreed = True


class AgreedFailure(HpclbError, RuntimeError):
    """A start-up check failed on some rank and every rank raises this, with that rank's
    message: no rank is left behind in a collective, so no MPI_Abort is needed."""

    agreed = True


class RunFinished(HpclbError):
    """``--resume`` of a run that is finished (its ``summary.json`` written): nothing is trained
    or written; raised on every rank together, its message the run's recorded summary."""

    exit_code = 0
    agreed = True


class NonFiniteError(HpclbError, FloatingPointError):
    """Raised on every rank after ``max_nonfinite_steps`` non-finite steps in a row.

    Attributes: ``step`` (the optimizer step, 1-based, at which the limit was reached),
    ``layer`` (the first parameter whose averaged gradient was not finite, or None when only the
    loss was), ``skipped`` (steps skipped in a row)."""

    exit_code = DIVERGED_EXIT_CODE
    agreed = True

    def __init__(self, step: int, layer: str | None, skipped: int):
        self.step, self.layer, self.skipped = step, layer, skipped
        where = f"first non-finite layer {layer}" if layer else "the loss was not finite"
        super().__init__(f"non-finite gradient at optimizer step {step} ({where}); {skipped} "
                         f"step(s) in a row skipped, the run stops: lower the learning rate, "
                         f"add warmup or gradient clipping (grad_clip_norm)")


class Preempted(HpclbError):
    """Raised on every rank after the preemption checkpoint is on disk; ``args[0]`` is the
    global step saved; ``args[1]`` is ``"interrupted"`` when a Ctrl-C asked for it (the
    command then exits 130, not 75: nothing to requeue)."""

    exit_code = PREEMPTED_EXIT_CODE
    agreed = True


class Diverged(HpclbError, RuntimeError):
    """Raised on every rank when the run stops on non-finite values (message: global step,
    epoch, first non-finite layer, the checkpoint kept). ``step``: the global step (1-based
    count of optimizer steps) at which it was detected, or None."""

    exit_code = DIVERGED_EXIT_CODE
    agreed = True

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


class KernelCompileError(HpclbError, RuntimeError):
    """The kernel source did not compile; ``log`` holds the compiler's messages."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message + (f"\n{log}" if log else ""))
        self.log = log


class MissingExtraError(HpclbError, ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra to install."""


class WarmupTooLong(HpclbError, ValueError):
    """Warmup is not shorter than training. ``problem`` states the two lengths; ``min_epochs``
    is (rounded up by the caller) the smallest training budget in epochs whose steps exceed the
    warmup at this batch (the warmup does not depend on the budget)."""

    exit_code = EXIT_USAGE
    agreed = True

    def __init__(self, warmup_steps: int, total_steps: int, steps_per_epoch: int,
                 min_epochs: float):
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.steps_per_epoch, self.min_epochs = steps_per_epoch, min_epochs
        self.problem = (f"warmup ({warmup_steps} steps = {warmup_steps / steps_per_epoch:.3g} "
                        f"epochs) must be shorter than training ({total_steps} steps = "
                        f"{total_steps / steps_per_epoch:.3g} epochs)")
        super().__init__(f"{self.problem}; train more epochs (at least {min_epochs:g} for "
                         f"this batch), use a smaller batch, or shorten warmup_epochs")


class BudgetTooLarge(HpclbError, ValueError):
    """A training budget of more optimizer steps than any run can mean: ``total_steps`` (at
    ``steps_per_epoch``) over ``max_steps`` (:data:`hpclb.schedules.MAX_TOTAL_STEPS`), most
    likely a unit or exponent slip (``epochs: 1.0e12``), which would train until killed.
    ``problem`` states the steps."""

    exit_code = EXIT_USAGE
    agreed = True

    def __init__(self, total_steps: int, steps_per_epoch: int, max_steps: int):
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.max_steps = max_steps
        self.problem = (f"{total_steps:.4g} optimizer steps ({total_steps / steps_per_epoch:.4g} "
                        f"epochs x {steps_per_epoch} steps per epoch) is more than the "
                        f"{max_steps:.0e} steps any run can mean")
        super().__init__(f"{self.problem}; give the training budget in epochs (e.g. 90)")
