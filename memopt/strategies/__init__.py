"""Memory strategies: one module each (typed options, rules, and the step that applies it), found by
the registry in ``base.py``. ``memopt.compose`` applies the selected ones in one fixed order."""
from memopt.strategies.base import Build, Strategy, register, registry

__all__ = ["Build", "Strategy", "register", "registry"]
