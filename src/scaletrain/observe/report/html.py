"""report.html: one self-contained page (inline CSS, images as data: URIs, no script, no external URL),
so that it opens offline and survives being mailed or attached to a bug report as a single file."""

from __future__ import annotations

import base64
import html
from datetime import datetime, timezone

from scaletrain import __version__
from scaletrain.observe.report.charts import Chart
from scaletrain.observe.report.load import Run

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f5f5f5; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #8a5a00; } .caption { color: #555; font-size: 0.9em; } code { font-size: 0.95em; }
"""


def render(runs: list[Run], rows: list[tuple[str, list[str]]], charts: list[Chart],
           png: dict[str, bytes]) -> str:
    """The page; ``png`` maps a chart's name to its encoded image (charts without one show their note)."""
    e = html.escape
    head = "".join(f"<th>{e(r.name)}</th>" for r in runs)
    body = "".join(f"<tr><th>{e(name)}</th>{''.join(f'<td>{e(v)}</td>' for v in values)}</tr>"
                   for name, values in rows)
    title = e(" vs ".join(r.name for r in runs))
    sources = ", ".join(f"<code>{e(str(r.path))}</code>" for r in runs)
    made = f"scaletrain {e(__version__)} on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    head_html = f"<head><meta charset='utf-8'><title>scaletrain report: {title}</title><style>{_CSS}</style></head>"
    parts = [f"<!DOCTYPE html><html lang='en'>{head_html}<body>",
             f"<h1>scaletrain report: {title}</h1>",
             f"<p class='caption'>From {sources}; made by {made}.</p>",
             f"<h2>Summary</h2><table><tr><th></th>{head}</tr>{body}</table>"]
    for chart in charts:
        parts.append(f"<h2 id='{chart.name}'>{e(chart.title)}</h2>")
        if chart.name in png:
            data = base64.b64encode(png[chart.name]).decode("ascii")
            parts.append(f"<img alt='{e(chart.title)}' src='data:image/png;base64,{data}'>")
            parts.append(f"<p class='caption'>{e(chart.caption)}</p>")
        if chart.note:
            parts.append(f"<p class='note'>Note: {e(chart.note)}</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
