"""Engines: who implements the selected strategies. ``memopt`` (compose.py) and the baselines."""


def build_engine(cfg, device, ctx, tracker):
    """The engine named by ``engine.name`` with the selected strategies applied."""
    if cfg.engine.name == "memopt":
        from memopt.compose import build

        return build(cfg, device, ctx, tracker)
    raise ValueError(f"engine.name={cfg.engine.name!r} is not available; use engine=memopt")
