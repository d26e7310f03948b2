"""Running the CLI in a subprocess into a temp dir, and reading report.html back."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from html.parser import HTMLParser

from tests.conftest import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUICK = ["trainer.max_steps=4", "trainer.eval_every=2", "trainer.log_every=1", "trainer.progress_bar=false",
         "trainer.save_checkpoint=false", "trainer.throughput_warmup_steps=1"]


def env(**extra: str) -> dict:
    e = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=REPO, **extra)
    e.pop("WANDB_API_KEY", None)
    return e


def run_module(module: str, args: list[str], cwd: str, timeout: int = 600, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)


def summaries(sweep: str) -> dict[str, dict]:
    """job dir name -> its summary.json, for every job of a sweep."""
    out = {}
    for job in sorted(os.listdir(sweep)):
        p = os.path.join(sweep, job, "summary.json")
        if os.path.exists(p):
            with open(p) as f:
                out[job] = json.load(f)
    return out


def device_peak_total(summary: dict) -> int | None:
    """The largest compute-device total over ranks (host excluded), straight from summary.json."""
    totals = [cats["total"] for devs in (summary.get("peak_bytes") or {}).values() for d, cats in devs.items() if d != "host"]
    return max(totals) if totals else None


class Tables(HTMLParser):
    """Every <table> of a page as a list of rows; a cell is (text, data-value or None); and every <img> src."""

    def __init__(self, text: str):
        super().__init__()
        self.tables: list[list[list[tuple[str, str | None]]]] = []
        self.images: list[dict] = []
        self._cell = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ["", a.get("data-value")]
        elif tag == "img":
            self.images.append(a)

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[0] += data

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append((self._cell[0], self._cell[1]))
            self._cell = None


def table_by_header(tables: Tables, first: str, contains: str) -> list[dict]:
    """Rows (header -> cell) of the first table whose header starts with ``first`` and names ``contains``."""
    for t in tables.tables:
        head = [c[0] for c in t[0]]
        if head and head[0] == first and contains in head:
            return [dict(zip(head, row)) for row in t[1:]]
    raise AssertionError(f"no table with header {first!r} ... {contains!r}")
