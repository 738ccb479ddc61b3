"""report.html: the report (report.md rendered) with its plots embedded, one file that opens anywhere, offline."""

from __future__ import annotations

import base64
import html
from pathlib import Path

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; color: #1d2330; max-width: 1180px; margin: 24px auto; padding: 0 18px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #e3e6ee; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #e3e6ee; padding: 3px 8px; text-align: left; } th { background: #f2f4f8; }
code { background: #f2f4f8; padding: 1px 4px; border-radius: 3px; font-size: 12px; }
figure { margin: 16px 0; } figure img { max-width: 100%; border: 1px solid #e3e6ee; }
figcaption { color: #6b7385; font-size: 12px; }
"""


def write_report_html(markdown_path: Path, plots: list[Path], path: Path) -> None:
    """Render `markdown_path` (report.md) to HTML and append every plot in `plots` as an embedded PNG."""
    import markdown

    body = markdown.markdown(markdown_path.read_text(), extensions=["tables"], output_format="html")
    figures = []
    for plot in plots:
        data = base64.b64encode(plot.read_bytes()).decode("ascii")
        figures.append(f'<figure><img alt="{html.escape(plot.stem)}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{html.escape(plot.name)}</figcaption></figure>")
    plots_html = ("<h2>Plots</h2>\n" + "\n".join(figures)) if figures else ""
    title = html.escape(markdown_path.read_text().splitlines()[0].lstrip("# ").strip() or "stepserve benchmark")
    path.write_text(f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
                    f"<style>{STYLE}</style></head>\n<body>\n{body}\n{plots_html}\n</body></html>\n")
