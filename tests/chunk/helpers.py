"""Run a job through the real loop (``run_job``) and keep the engine it built, to read its metrics."""
from __future__ import annotations

import json
import os

from tests.conftest import train


def train_capture(overrides: list[str], run_dir: str, monkeypatch) -> tuple[dict, object]:
    import memopt.engines as engines

    built = []
    orig = engines.build_engine

    def capture(*a, **k):
        e = orig(*a, **k)
        built.append(e)
        return e

    monkeypatch.setattr(engines, "build_engine", capture)
    summary = train(overrides, run_dir)
    monkeypatch.setattr(engines, "build_engine", orig)
    return summary, built[0]


def records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]
