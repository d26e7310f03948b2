"""Engines: who implements the selected strategies. ``memopt`` (compose.py) and the baselines."""


def build_engine(cfg, device, ctx, tracker):
    """The engine named by ``engine.name`` with the selected strategies applied."""
    if cfg.engine.name == "memopt":
        from memopt.compose import build

        return build(cfg, device, ctx, tracker)
    if cfg.engine.name == "deepspeed":
        from memopt.engines.deepspeed import build as build_deepspeed

        return build_deepspeed(cfg, device, ctx, tracker)
    if cfg.engine.name == "fsdp2":
        from memopt.engines.fsdp2 import build as build_fsdp2

        return build_fsdp2(cfg, device, ctx, tracker)
    raise ValueError(f"engine.name={cfg.engine.name!r} is not available; use engine=memopt, deepspeed or fsdp2")
