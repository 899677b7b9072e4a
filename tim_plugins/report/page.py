"""HTML building blocks of the report: the page frame, a verdict block, figures with "how to read it" and the
healthy range, tables, and the numbered sources. Self-contained: CSS inline, figures as data: URIs."""

from __future__ import annotations

import base64
import html
import math

__all__ = ["Page", "fmt"]

_STATUSES = ("ok", "watch", "act")  # the verdict statuses with a colour (health.STATUSES); anything else is "na"

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1180px;margin:1.5em auto;padding:0 1em;
color:#1d2329;line-height:1.4}
h1{font-size:1.55em;margin:.2em 0 .4em}h2{font-size:1.2em;margin:1.6em 0 .5em;border-bottom:1px solid #dde;
padding-bottom:.2em}
.verdict{border-radius:6px;padding:.8em 1.1em;margin:.8em 0 1.2em;border-left:6px solid}
.verdict.ok{background:#eef8ec;border-color:#3c9a3c}.verdict.watch{background:#fff7e6;border-color:#e0a100}
.verdict.act{background:#fdecec;border-color:#d03030}.verdict.na{background:#f2f3f5;border-color:#889}
.verdict .headline{font-weight:600;font-size:1.05em;margin-bottom:.4em}.verdict ul{margin:.3em 0 .2em 1.2em;padding:0}
.verdict li{margin:.15em 0}.tag{display:inline-block;min-width:3.6em;text-align:center;font-size:.78em;font-weight:600;
border-radius:3px;padding:0 .3em;margin-right:.4em;color:#fff}.tag.ok{background:#3c9a3c}.tag.watch{background:#c98d00}
.tag.act{background:#d03030}.tag.na{background:#889}
figure{margin:1em 0 1.6em}figure img{max-width:100%;height:auto;display:block;border:1px solid #eee}
figcaption{font-size:.88em;color:#333;max-width:980px;margin-top:.35em}figcaption b{color:#1d2329}
figcaption .healthy{display:block;color:#2f6b2f;margin-top:.15em}
table{border-collapse:collapse;margin:.6em 0 1em;font-size:.86em}td,th{border:1px solid #d6d9de;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f4f5f7}td.num{text-align:right;font-variant-numeric:tabular-nums;
white-space:nowrap}
td.ok{background:#dcf0d5}td.watch{background:#ffedbf}td.act{background:#f9d0d0}
.note{background:#f4f5f8;padding:.5em .9em;border-left:3px solid #889;font-size:.9em}
.sources{font-size:.82em;color:#444}.sources li{margin:.2em 0}
td.ctx{font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all;max-width:640px}
td.ctx mark{background:#ffd35c;border-radius:2px;padding:0 1px}td.ctx .edge{color:#889;font-size:.85em}
details{margin:.4em 0 .8em}summary{cursor:pointer}
"""


def fmt(v) -> str:
    """Numbers to 4 significant digits (ints as ints), everything else as escaped text."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    if v is None:
        return "—"
    return html.escape(str(v))


class Page:
    """Collects sections; `html()` renders them. Sources are numbered in order of first citation."""

    def __init__(self, title: str, sources: dict[str, str]) -> None:
        self.title = title
        self._sources = sources
        self._cited: list[str] = []
        self.parts: list[str] = []

    def cite(self, key: str) -> str:
        if key not in self._cited:
            self._cited.append(key)
        n = self._cited.index(key) + 1
        return f"<a href='#src{n}'>[{n}]</a>"

    def h2(self, text: str) -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>")

    def note(self, text: str) -> None:
        self.parts.append(f"<p class='note'>{html.escape(text)}</p>")

    def raw(self, markup: str) -> None:
        self.parts.append(markup)

    def verdict(self, v: dict, extra: list[str] = ()) -> None:
        """The block at the top: headline, one line per checked metric, then ``extra`` lines (plain text).

        ``v`` may be a verdict stored in ``summary.json`` (another version's, or edited): nothing of it reaches the
        markup unescaped, and a status or line this version does not know is shown neutrally, never raised on."""
        cls = v.get("status") if v.get("status") in _STATUSES else "na"
        items = "".join(self._verdict_line(line) for line in (v.get("lines") or []))
        items += "".join(f"<li>{html.escape(str(line))}</li>" for line in (extra or []))
        self.parts.append(f"<div class='verdict {cls}'><div class='headline'>"
                          f"{html.escape(str(v.get('headline', '')))}</div><ul>{items}</ul></div>")

    def _verdict_line(self, line) -> str:
        """One (status, text, source) line: the tag's class and label come from the fixed statuses only (the stored
        status is data, not markup); an unknown status gets the neutral tag "?", an unknown source its key as text."""
        if not isinstance(line, (list, tuple)) or len(line) != 3:
            return f"<li><span class='tag na'>?</span>{html.escape(str(line))}</li>"
        st, text, src = line
        known = st if isinstance(st, str) and st in _STATUSES + ("n/a",) else None
        tag = (f"<span class='tag {'na' if known in (None, 'n/a') else known}'>"
               f"{'?' if known is None else known.upper()}</span>")
        return f"<li>{tag}{html.escape(str(text))}{' ' + self.cite(str(src)) if src else ''}</li>"

    def figure(self, png: bytes, title: str, how: str, healthy: str | None = None, source: str | None = None,
               alt: str | None = None) -> None:
        data = base64.b64encode(png).decode()
        cite = f" {self.cite(source)}" if source else ""
        healthy_html = (f"<span class='healthy'>Healthy: {html.escape(healthy)}{cite}</span>" if healthy else
                        (f"<span class='healthy'>No published threshold; theory:{cite}</span>" if cite else
                         "<span class='healthy'>No published threshold.</span>"))
        self.parts.append(
            f"<figure><img src='data:image/png;base64,{data}' alt='{html.escape(alt or title)}'>"
            f"<figcaption><b>{html.escape(title)}.</b> How to read it: {html.escape(how)}{healthy_html}"
            "</figcaption></figure>")

    def table(self, header: list[str], rows: list[list], classes: list[list[str | None]] | None = None) -> None:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = []
        for r, row in enumerate(rows):
            cells = []
            for c, v in enumerate(row):
                cls = ["num"] if isinstance(v, (int, float)) and not isinstance(v, bool) else []
                if classes and classes[r][c]:
                    cls.append(classes[r][c])
                attr = f" class='{' '.join(cls)}'" if cls else ""
                cells.append(f"<td{attr}>{fmt(v)}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        self.parts.append(f"<table><tr>{head}</tr>{''.join(body)}</table>")

    def html(self) -> str:
        # a source key this version has no text for (a stored verdict's line) is listed as its key, not raised on
        sources = "".join(f"<li id='src{i + 1}'>{html.escape(self._sources.get(k, f'{k} (no text for this source)'))}"
                          "</li>" for i, k in enumerate(self._cited))
        tail = f"<h2>Sources of the healthy ranges</h2><ol class='sources'>{sources}</ol>" if sources else ""
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<style>{_CSS}</style></head><body><h1>{html.escape(self.title)}</h1>{''.join(self.parts)}"
                f"{tail}</body></html>")
