"""report.html: one self-contained file (inline CSS, figures embedded as base64 PNG) to mail or attach.

Table cells carry the exact number they show in ``data-value`` so that a reader (or a test) can get
the unrounded value back from the page.
"""
from __future__ import annotations

import base64
import html
import os

CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px}
th{background:#f3f3f3}td[data-value]{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#555}"""


def _table(head, rows) -> str:
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = []
        for text, value in row:
            attr = f' data-value="{value!r}"' if value is not None else ""
            cells.append(f"<td{attr}>{html.escape(str(text))}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _figure(caption: str, path: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    name = html.escape(os.path.basename(path))
    return (f'<figure><img alt="{html.escape(caption)}" data-file="{name}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def render(doc: list[tuple]) -> str:
    body = []
    for item in doc:
        kind = item[0]
        if kind in ("h1", "h2"):
            body.append(f"<{kind}>{html.escape(item[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{html.escape(item[1])}</p>")
        elif kind == "table":
            body.append(_table(*item[1]))
        elif kind == "figure":
            body.append(_figure(item[1], item[2]))
    title = next((html.escape(i[1]) for i in doc if i[0] == "h1"), "report")
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{title}</title><style>{CSS}</style></head>\n'
            f"<body>\n" + "\n".join(body) + "\n</body></html>\n")


def write(doc: list[tuple], out_dir: str) -> str:
    path = os.path.join(out_dir, "report.html")
    with open(path, "w") as f:
        f.write(render(doc))
    return path
