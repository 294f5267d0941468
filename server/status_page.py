"""The status page: status_report.py's dict as one self-contained HTML page.

    html = render_status(shard_report(...))   # served at /status on the metrics port

Plain server-rendered HTML: styles inline, no script, no external asset (it works offline
and behind any proxy), every value escaped. It reloads itself every REFRESH_S seconds; the
same content as JSON is at /status.json.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Sequence
from typing import Any

REFRESH_S = 5

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin-top: 1.6em; }
table { border-collapse: collapse; } td, th { padding: 3px 10px; border-bottom: 1px solid #ddd; }
th { text-align: left; background: #f4f4f4; } td.n { text-align: right; }
.bad { color: #b00020; font-weight: 600; } .ok { color: #1b7a2a; } .dim { color: #888; }
"""


def render_status(report: dict[str, Any]) -> str:
    shard = report["shard"]
    title = f"diloco shard {shard['index']} of {shard['count']}"
    parts = [
        f"<p>mode <b>{_e(shard['mode'])}</b>"
        f"{' · untrusted learners: influence bounded' if shard['untrusted_learners'] else ''}"
        f" · map <code>{_e(shard['map_id'] or '-')}</code>"
        f" · bytes in <b id='bytes-in'>{_bytes(report['bytes']['received'])}</b>,"
        f" out <b id='bytes-out'>{_bytes(report['bytes']['sent'])}</b>"
        f" · <a href='status.json'>JSON</a></p>",
        "<h2>Fragments</h2>",
        _table(
            ("fragment", "version", "owner", "last close", "round", "quorum / grace"),
            [_fragment_cells(f) for f in report["fragments"]],
            "fragments",
        ),
        "<h2>Learners</h2>",
        _table(
            (
                "learner",
                "live",
                "last push",
                "staleness",
                "tokens trained",
                "last weight share",
                "refused by guards",
            ),
            [_learner_cells(x) for x in report["learners"]],
            "learners",
        ),
        "<h2>State</h2>",
        _state(report["state"]),
        "<h2>Shards</h2>",
        _table(
            ("shard", "address", "status page"),
            [_shard_cells(s, shard["index"]) for s in report["shards"]],
            "shards",
        ),
    ]
    if report["setting_changes"]:
        changes = (f"{c['setting']} {c['was']!r} → {c['now']!r}" for c in report["setting_changes"])
        parts.append(f"<p>Changed at the last restart: {_e('; '.join(changes))}</p>")
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(report["generated_at"]))
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='refresh' content='{REFRESH_S}'>"
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{_e(title)}</h1>{''.join(parts)}"
        f"<p class='dim'>{_e(generated)}; reloads every {REFRESH_S} s</p></body></html>"
    )


def _fragment_cells(f: dict[str, Any]) -> list[str]:
    rnd = f["round"]
    version = _e(f["version"]) if f["version"] >= 0 else "<span class='dim'>no parameters</span>"
    waiting = f"{rnd['pushes']} pushed, {rnd['awaited']} awaited"
    if rnd["grace_left_s"] is not None:
        quorum = f"quorum reached; grace {rnd['grace_left_s']:.1f} s left"
    else:
        quorum = f"needs {rnd['quorum']}"
    return [_e(f["fragment"]), version, _e(f["owner"]), _ago(f["last_close_s_ago"]), _e(waiting),
            _e(quorum)]  # fmt: skip


def _learner_cells(x: dict[str, Any]) -> list[str]:
    live = "<span class='ok'>live</span>" if x["live"] else "<span class='dim'>gone</span>"
    pushed = x["last_push_version"] >= 0
    last = f"{_ago(x['last_push_s_ago'])} (fragment {x['last_push_fragment']})" if pushed else "-"
    refused = f"<span class='bad'>{x['refused']}</span>" if x["refused"] else "0"
    staleness = _e(x["staleness"]) if x["staleness"] >= 0 else "-"
    return [_e(x["learner_id"]), live, last, staleness, _e(f"{x['tokens']:,}"),
            _e(f"{x['weight_share']:.1%}"), refused]  # fmt: skip


def _state(state: dict[str, Any]) -> str:
    if not state["dir"]:
        return "<p class='dim'>no state dir: nothing survives a restart</p>"
    rows = []
    for kind in ("snapshot", "log"):
        entry = state[kind]
        age = _ago(entry["age_s"]) if entry else "-"
        rows.append([kind, age, _bytes(entry["bytes"]) if entry else "-"])
    error = state["error"]
    status = f"<p class='bad'>error: {_e(error)}</p>" if error else "<p class='ok'>writable</p>"
    return f"<p><code>{_e(state['dir'])}</code></p>{status}" + _table(
        ("file", "written", "size"), rows, "state"
    )


def _shard_cells(s: dict[str, Any], own: int) -> list[str]:
    name = f"{s['index']} (this one)" if s["index"] == own else str(s["index"])
    url = s["status_url"]
    link = f"<a href='{_e(url)}'>{_e(url)}</a>" if url else "<span class='dim'>unknown</span>"
    return [_e(name), _e(s["address"] or "-"), link]


def _table(headers: Sequence[str], rows: Iterable[list[str]], name: str) -> str:
    """A table of already escaped cells (numbers right-aligned)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td{_align(c)}>{c}</td>" for c in row) + "</tr>" for row in rows
    )
    body = body or f"<tr><td colspan='{len(headers)}' class='dim'>none</td></tr>"
    return f"<table id='{name}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _align(cell: str) -> str:
    return " class='n'" if cell.replace(",", "").replace(".", "").isdigit() else ""


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s ago"


def _bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)
