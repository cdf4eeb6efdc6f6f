"""`moestream top`: a local server's live figures in the terminal (rich), refreshed every second (README:
the hit rate per layer over recent steps, tiers, transfers, prediction, bytes, latency, requests).

It reads GET /v1/moestream/stats (moestream/serving/live.py) and knows nothing of the engine.
"""

from __future__ import annotations

import time

from moestream.budget import format_bytes
from moestream.checks import check_loopback, require_serve_extra
from moestream.errors import MoestreamError
from moestream.report import fmt

REFRESH_S = 1.0
HEATMAP_STEPS = 60  # the most recent steps shown
CELL = "■"
PCT = "{:.1%}"


def add_parser(commands) -> None:
    parser = commands.add_parser("top", help="watch a local server's expert cache, live")
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (loopback only)")
    parser.add_argument("--api-key", help="bearer key of the server")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from urllib.parse import urlparse

    try:  # a URL that is no server address (http or https, with a host) is refused in one line naming --url
        parsed = urlparse(args.url)
        valid = parsed.scheme in ("http", "https") and bool(parsed.hostname) and (parsed.port or 0) >= 0
    except ValueError:  # an unclosed [IPv6 host, a port that is no number
        valid = False
    if not valid:
        raise MoestreamError(f"--url: expected a server address such as http://127.0.0.1:8000, got {args.url!r}")
    require_serve_extra()
    import httpx
    from rich.console import Console
    from rich.live import Live

    check_loopback(args.url, "--url: top only watches")
    with httpx.Client(base_url=args.url, timeout=5.0,
                      headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}) as client:
        if args.once:
            Console().print(frame(fetch(client, args.url)))
            return 0
        try:
            with Live(frame(fetch(client, args.url)), refresh_per_second=4, screen=False) as live:
                while True:
                    time.sleep(REFRESH_S)
                    live.update(frame(fetch(client, args.url)))
        except KeyboardInterrupt:
            return 0


def fetch(client, url: str) -> dict:
    """The server's live figures; one-line errors when it cannot be reached or refuses."""
    import httpx

    try:
        answer = client.get("/v1/moestream/stats")
    except httpx.HTTPError as error:
        raise MoestreamError(f"--url: cannot reach the server at {url} ({type(error).__name__})") from None
    if answer.status_code == 401:
        raise MoestreamError(f"--api-key: the server at {url} needs a valid API key")
    if answer.status_code != 200:
        raise MoestreamError(f"--url: {url}/v1/moestream/stats answered {answer.status_code}")
    return answer.json()


def frame(stats: dict):
    """One screen of figures (a rich renderable)."""
    from rich.columns import Columns
    from rich.console import Group
    from rich.panel import Panel

    tables = [_tiers(stats)] + [_table(title, rows) for title, rows in _figures(stats)]
    title = f"moestream top: {stats['tokens']} tokens, hit rate {fmt(stats['hit_rate'], PCT)}"
    return Group(Panel(_heatmap(stats), title=title, title_align="left"), Columns(tables, padding=(0, 2)))


def _heatmap(stats: dict):
    from rich.text import Text

    rates = stats["heatmap"]["hit_rate"][-HEATMAP_STEPS:]  # [S][L]
    text = Text()
    for layer in range(stats["layers"]):
        text.append(f"layer {layer:>3} ", style="dim")
        for column in rates:
            text.append(CELL, style=_color(column[layer]))
        text.append("\n")
    text.append(f"{'':10}{len(rates)} recent steps, newest right; red 0% .. green 100%", style="dim")
    return text


def _color(rate: float | None) -> str:
    if rate is None:
        return "grey30"
    red, green = round(220 * (1 - rate) + 40 * rate), round(60 * (1 - rate) + 190 * rate)
    return f"rgb({red},{green},70)"


def _table(title: str, rows: list[tuple]):
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    if rows and len(rows[0]) == 2:  # a name and its value
        table.add_column(style="dim")
        table.add_column(justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def _tiers(stats: dict):
    from rich.progress_bar import ProgressBar

    return _table("tiers", [(tier, ProgressBar(total=max(slots["total"], 1), completed=slots["used"], width=20),
                             f"{slots['used']}/{slots['total']}") for tier, slots in stats["tiers"].items()])


def _figures(stats: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, rows of a name and its value) of each small table."""
    transfers, p, latency, requests = stats["transfers"], stats["prediction"], stats["latency_s"], stats["requests"]
    host = stats.get("host_compute") or {"rule": "off", "experts": 0, "share": None}
    return [("transfers", [(name.replace("_", " "), str(transfers[name])) for name in ("in_flight", "late", "cancelled")]
             + [(f"misses on host ({host['rule']})", fmt(host["share"], PCT))]),
            ("prediction", [("precision", fmt(p["precision"], PCT)), ("recall", fmt(p["recall"], PCT)),
                            ("prefetched", str(p["prefetched"])), ("wasted", str(p["wasted"]))]),
            ("bytes/token", [(f"from {tier}", fmt(n, lambda x: format_bytes(round(x))))
                             for tier, n in stats["bytes_per_token"].items()]),
            ("latency (s)", [(f"{name.upper()} {q}", fmt(latency[name][q], "{:.3g}"))
                             for q in ("p50", "p90", "p99") for name in ("ttft", "tpot")]),
            ("requests", [(name, str(requests[name])) for name in ("running", "waiting")])]
