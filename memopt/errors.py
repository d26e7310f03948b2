"""Error types and run statuses shared across memopt."""

# Every run ends with one status in summary.json and one process exit code (README, "Run records").
EXIT_CODES = {"ok": 0, "failed": 1, "refused": 2, "oom": 3, "diverged": 4, "interrupted": 130}


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the fields and what would work.

    Raised before anything big is allocated; the run's summary records status ``refused``.
    """
