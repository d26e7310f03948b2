"""Error types shared across memopt."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the fields and what would work.

    Raised before anything big is allocated; the run's summary records status ``refused``.
    """
