"""The errors the course raises on purpose: one base class, one subclass per area. Explained in 00_setup.

Every message says what was wrong and how to fix it, in the learner's language. Each class also derives from the
built-in exception a Python programmer would expect (``ValueError`` for a bad value, ``FileNotFoundError`` for
missing data, ...), so ``except ValueError`` keeps working. Command-line entry points catch ``MparlibError`` alone:
any other exception is a bug and shows its traceback.
"""


class MparlibError(Exception):
    """Base class of the course's errors: the message explains the problem and its fix. Explained in 00_setup."""


class ConfigError(MparlibError, ValueError):
    """A setting or argument has a value that cannot work (``lr=nan``, ``nproc=0``, ...). Explained in 00_setup."""


class DeviceError(MparlibError, ValueError):
    """A device that does not exist on this machine, or cannot be used that way. Explained in 00_setup."""


class DataError(MparlibError):
    """A problem with the data set files. Explained in 00_setup."""


class DataNotFoundError(DataError, FileNotFoundError):
    """Fashion-MNIST is not where it was looked for and could not be downloaded. Explained in 00_setup."""


class CorruptDataError(DataError, ValueError):
    """A data file exists but is damaged or is not the data set expected. Explained in 00_setup."""


class CheckpointError(MparlibError, ValueError):
    """A checkpoint cannot be written or read back (foreign, damaged, or refused). Explained in 00_setup."""


class CheckpointMismatchError(CheckpointError, RuntimeError):
    """A checkpoint that does not fit the model: ``missing``, ``unexpected``, ``shapes`` say how. Explained in 02_wrapped_attributes."""

    def __init__(self, message, missing=(), unexpected=(), shapes=()):
        super().__init__(message)
        self.missing, self.unexpected, self.shapes = list(missing), list(unexpected), list(shapes)


class LaunchError(MparlibError, RuntimeError):
    """Processes cannot be started, cannot meet, or cannot form a process group. Explained in 00_setup."""


class WorkerFailed(LaunchError):
    """A process started by ``mparlib.launch.launch`` failed; the message names the rank and ends with its log.

    Explained in 06_ddp. ``rank`` is the rank that failed first and ``cause`` says how, in one line (both ``None``
    when unknown); the full message adds the end of that rank's log. ``limit`` is the run's limit (seconds) when the
    run was stopped for going past it, else ``None``.
    """

    def __init__(self, message, *, rank=None, cause=None, limit=None):
        super().__init__(message)
        self.rank, self.cause, self.limit = rank, cause, limit


class TrainingDiverged(MparlibError, ArithmeticError):
    """The loss became NaN or infinite; the message names the epoch and the step. Explained in 00_setup."""


class OutputLocked(MparlibError, RuntimeError):
    """Another run is writing into the same output folder; the message names it. Explained in 00_setup."""
