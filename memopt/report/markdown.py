"""report.md: the report's document as GitHub-flavoured markdown (figures linked as relative PNGs)."""
from __future__ import annotations

import os


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(doc: list[tuple], out_dir: str) -> str:
    out = []
    for item in doc:
        kind = item[0]
        if kind == "h1":
            out.append(f"# {item[1]}\n")
        elif kind == "h2":
            out.append(f"## {item[1]}\n")
        elif kind == "p":
            out.append(f"{item[1]}\n")
        elif kind == "table":
            head, rows = item[1]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "|".join("---" for _ in head) + "|")
            out += ["| " + " | ".join(_cell(c[0]) for c in row) + " |" for row in rows]
            out.append("")
        elif kind == "figure":
            rel = os.path.relpath(item[2], out_dir).replace(os.sep, "/")
            out.append(f"![{item[1]}]({rel})\n")
    return "\n".join(out)


def write(doc: list[tuple], out_dir: str) -> str:
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write(render(doc, out_dir))
    return path
