"""Error types and run statuses shared across memopt."""

# Every run ends with one status in summary.json and one process exit code (README, "Run records").
EXIT_CODES = {"ok": 0, "failed": 1, "refused": 2, "oom": 3, "diverged": 4, "interrupted": 130}


def status_of(exc: BaseException) -> str:
    """The one mapping of how a run ended to its status (``EXIT_CODES`` gives the exit code): the run's own
    stops carry theirs, a refusal is ``refused``, an out-of-memory (the allocator's, the tracker's device
    budget, the chunk engine's) is ``oom``, Ctrl-C ``interrupted``, anything else ``failed``."""
    import torch

    if isinstance(exc, RunStopped):
        return exc.status
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, ConfigError):
        return "refused"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    return "failed"


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the fields and what would work.

    Raised before anything big is allocated; the run's summary records status ``refused``.
    """


class RunStopped(Exception):
    """The loop stopped the run on purpose; ``status`` is what summary.json records."""

    status = "failed"


class Diverged(RunStopped):
    """Non-finite losses (or fp16 steps all skipped) for ``trainer.divergence_steps`` steps in a row."""

    status = "diverged"


class Interrupted(RunStopped):
    """SIGTERM or SIGINT: the run stopped at a step boundary (after a checkpoint when they are on)."""

    status = "interrupted"


class StopRequest(BaseException):
    """SIGTERM or SIGINT while the command plans, before any rank starts (``outcome.stops_raise``): a
    BaseException, as KeyboardInterrupt is, so that no ``except Exception`` of the planner (a probe that could
    not run, a candidate that could not be planned) takes it for that step's failure and goes on."""


class Stalled(RunStopped):
    """The watchdog found a rank without progress for ``trainer.watchdog_s`` and stopped the job; the
    message names the rank and its phase (the ranks' own exit, a SIGKILL, is not the cause)."""

    status = "failed"


class Recorded(RunStopped):
    """The ranks ended with an outcome rank 0 recorded in summary.json (``status``); the launcher's
    account of it, one line, no traceback."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class WriteError(RuntimeError):
    """The run's own files could not be written (a full disk, a read-only or vanished directory): the
    message names the file, the reason and the free space; status ``failed``, one line, no traceback."""
