"""The runs of a W&B group as report records: ``python -m memopt.report wandb:ENTITY/PROJECT/GROUP``.

For sweeps whose run directories are elsewhere (a cluster's scratch disk) but whose runs were synced.
memopt.logging flattens summaries and per-step dicts with ``/`` (``peak_bytes/0/cpu/params``,
``chunk/evictions``); they are nested back into the summary.json / metrics.jsonl shapes, so the report
code reads both sources the same way. W&B keeps the resolved config, not Hydra's overrides, so a run is
labelled by the config values that differ between the runs of the group.
"""
from __future__ import annotations

from memopt.report.collect import Run, label_runs

PREFIX = "wandb:"
LABEL_GROUPS = ("trainer", "data", "optim", "hardware", "parallel", "seed")


def is_wandb_source(s: str) -> bool:
    return s.startswith(PREFIX)


def parse(source: str) -> tuple[str, str]:
    """``wandb:entity/project/group`` -> (``entity/project``, ``group``)."""
    parts = source[len(PREFIX):].strip("/").split("/")
    if len(parts) < 2:
        raise ValueError(f"{source}: expected wandb:ENTITY/PROJECT/GROUP or wandb:PROJECT/GROUP")
    return "/".join(parts[:-1]), parts[-1]


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        node = out
        *parents, leaf = str(key).split("/")
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[leaf] = v
    return out


def _leaves(d, prefix=""):
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _pseudo_overrides(config: dict, engine, strategy: list[str], model) -> list[str]:
    out = [f"engine={engine}", f"strategy=[{','.join(strategy)}]", f"model={model}"]
    for group in LABEL_GROUPS:
        v = config.get(group)
        if isinstance(v, dict):
            out += [f"{group}.{k}={x}" for k, x in _leaves(v)]
        elif v is not None:
            out.append(f"{group}={v}")
    return out


def collect_group(source: str, api=None) -> list[Run]:
    """Every run of the group, oldest first. ``api`` is a ``wandb.Api()`` (the network)."""
    path, group = parse(source)
    if api is None:
        import wandb

        api = wandb.Api()
    runs = []
    for r in api.runs(path, filters={"group": group}):
        summary = unflatten({k: v for k, v in dict(r.summary).items() if not str(k).startswith("_")})
        if isinstance(summary.get("strategy"), str):  # lists are logged joined by commas
            summary["strategy"] = [s for s in summary["strategy"].split(",") if s]
        config = {k: v for k, v in dict(r.config).items() if not str(k).startswith("_")}
        engine = summary.get("engine") or (config.get("engine") or {}).get("name")
        strategy = list(summary.get("strategy") or [])
        model = summary.get("model") or (config.get("model") or {}).get("name")
        metrics = []
        for row in r.scan_history():
            rec = unflatten({k: v for k, v in row.items() if not str(k).startswith("_") and v is not None})
            if "loss" in rec:
                metrics.append({"step": row.get("_step"), **rec})
        runs.append(Run(job=r.name or r.id, path=f"{path}/{r.id}", status=summary.get("status") or r.state,
                        engine=engine, strategy=strategy, model=model, world_size=summary.get("world_size"),
                        overrides=_pseudo_overrides(config, engine, strategy, model), summary=summary, config=config,
                        metrics=metrics, wandb_id=r.id, group=group))
    label_runs(runs)
    return runs
