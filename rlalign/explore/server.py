"""``rlalign explore --serve``: the explorers as live local web pages.

One page per explorer (and an index): the parameters the seed lets the reader move, as sliders and
selectors with their ranges (each module's ``PARAMS``); the figure, recomputed by the module's
``compute()`` (which calls :mod:`rlalign.core`) whenever a value changes and drawn by plotly.js from
the module's ``figure(result)``; the explorer's equations, rendered by matplotlib's mathtext; and
downloads of the current figure as the PNG and the JSON numbers ``rlalign explore NAME`` writes.

A small Starlette app served by uvicorn. Every asset comes from an installed package: plotly.js from
the ``plotly`` wheel, the page's script and style from this package, the equations as SVG rendered
here. Nothing is fetched from the network.

Safety: it binds to the loopback address unless told otherwise and then answers only requests whose
Host header names this machine (so a web page elsewhere cannot reach it by DNS rebinding); it
takes no file paths from the page (the routes name explorers, which are looked up in the registry);
every parameter is checked against its declared range (:func:`rlalign.explore.params.parse_params`);
a malformed request gets a 4xx JSON answer with a message and an internal error a 500 with one line,
never a traceback.
"""

from __future__ import annotations

import functools
import html
import io
import json
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from rlalign.errors import RLAlignError
from rlalign.listen import base_url, bound_socket
from rlalign.explore._common import to_jsonable
from rlalign.explore.params import ParamError, keywords, parse_params
from rlalign.explore.registry import EXPLORERS, Explorer

try:
    import plotly
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.requests import Request
    from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles
except ImportError as err:  # the static PNG path (rlalign explore NAME) works without these
    raise RLAlignError(f"rlalign explore --serve needs the explore extra ({err.name} is missing): pip install 'rlalign[explore]'") from err

__all__ = ["create_app", "serve", "start_in_thread", "LOOPBACK"]

LOOPBACK = "127.0.0.1"
STATIC_DIR = Path(__file__).parent / "static"
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; "
    "script-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

_compute_lock = threading.Lock()  # one computation at a time: the explorers are CPU-bound on a small machine
_render_lock = threading.Lock()  # matplotlib's mathtext parser (equations, log-axis tick labels) is not thread-safe
_cache: OrderedDict[tuple, Any] = OrderedDict()  # (name, compute values) -> result, the last CACHE_SIZE
CACHE_SIZE = 128


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class SecurityHeaders:
    """ASGI middleware: SECURITY_HEADERS on every response, static files and errors included."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *((k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items())]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _explorer(request: Request) -> Explorer:
    name = request.path_params["name"]
    if name not in EXPLORERS:
        raise HTTPException(404, f"unknown explorer {name[:40]!r}; choose one of {', '.join(EXPLORERS)}")
    return EXPLORERS[name]


def _computed(name: str, frozen_values: tuple[tuple[str, Any], ...]) -> tuple[Any, float | None]:
    """(compute(**keywords), seconds it took or None when it came from the cache). Cached, so the figure and
    its downloads are the same numbers, and moving a figure-stage control recomputes nothing."""
    explorer, key = EXPLORERS[name], (name, frozen_values)
    with _compute_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key], None
        start = time.perf_counter()
        result = explorer.load().compute(**keywords(explorer.params, dict(frozen_values), "compute"))
        seconds = time.perf_counter() - start
        _cache[key] = result
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
        return result, seconds


def _result(request: Request) -> tuple[Explorer, dict[str, Any], Any, float | None, dict[str, Any]]:
    """(explorer, parsed values, result, compute seconds or None if cached, figure keywords) of a request."""
    explorer = _explorer(request)
    values = parse_params(explorer.params, request.query_params)
    compute_values = tuple(sorted((p.name, values[p.name]) for p in explorer.params if p.stage == "compute"))
    result, seconds = _computed(explorer.name, compute_values)
    return explorer, values, result, seconds, keywords(explorer.params, values, "figure")


def warm_up() -> None:
    """Compute every explorer at its page's defaults once (first calls pay for imports and torch's warm-up)."""
    for name, explorer in EXPLORERS.items():
        _computed(name, tuple(sorted((p.name, p.default) for p in explorer.params if p.stage == "compute")))


@functools.lru_cache(maxsize=None)
def _equation_svg(name: str, index: int) -> bytes:
    from matplotlib import mathtext
    from matplotlib.font_manager import FontProperties

    buffer = io.BytesIO()
    with _render_lock:
        mathtext.math_to_image(EXPLORERS[name].equations[index][1], buffer, format="svg", prop=FontProperties(size=16, math_fontfamily="cm"))
    return buffer.getvalue()


# ---------------------------------------------------------------- pages


def _page(title: str, body: str) -> HTMLResponse:
    return HTMLResponse(
        "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{html.escape(title)}</title>"
        "<link rel='icon' href='data:,'><link rel='stylesheet' href='/static/app.css'></head>"
        f"<body>{body}</body></html>",
    )


def index(request: Request) -> HTMLResponse:
    rows = "".join(
        f"<li><a href='/explorer/{e.name}'>{e.name}</a> <span class='seed'>{html.escape(e.seed_name)}</span>"
        f"<p>{html.escape(e.summary)}</p></li>"
        for e in EXPLORERS.values()
    )
    return _page("rlalign explorers", f"<main class='index'><h1>rlalign explorers</h1><p>The seeds' explorers, computed live by "
                 f"<code>rlalign.core</code>. Pick one:</p><ul id='explorers'>{rows}</ul></main>")


def _control(param, value) -> str:
    name, label = html.escape(param.name), html.escape(param.label)
    tip = f" title='{html.escape(param.help)}'" if param.help else ""
    if param.kind == "choice":
        options = "".join(f"<option{' selected' if c == value else ''}>{html.escape(c)}</option>" for c in param.choices)
        widget = f"<select id='p-{name}' name='{name}' data-param>{options}</select>"
    else:
        widget = (f"<input type='range' id='p-{name}' name='{name}' data-param min='{param.low:.12g}' max='{param.high:.12g}' "
                  f"step='{param.step:.12g}' value='{value:.12g}'>")
    return f"<div class='control'{tip}><label for='p-{name}'>{label}</label>{widget}<output for='p-{name}'>{html.escape(str(value))}</output></div>"


def explorer_page(request: Request) -> HTMLResponse:
    explorer = _explorer(request)
    values = parse_params(explorer.params, request.query_params)  # a shared link opens at its values
    controls = "".join(_control(p, values[p.name]) for p in explorer.params if not p.size)
    sizes = "".join(_control(p, values[p.name]) for p in explorer.params if p.size)
    if sizes:
        controls += f"<div class='sizes'><span class='group'>problem size (larger is slower)</span>{sizes}</div>"
    equations = "".join(
        f"<figure class='equation'><img src='/equation/{explorer.name}/{i}.svg' alt='{html.escape(tex)}'>"
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        for i, (caption, tex) in enumerate(explorer.equations)
    )
    query = html.escape(urlencode(values))
    body = (
        f"<main id='explorer' data-name='{explorer.name}' data-state='loading' data-query=''>"
        f"<nav><a href='/'>&larr; all explorers</a></nav><h1>{explorer.name} <span class='seed'>{html.escape(explorer.seed_name)}</span></h1>"
        f"<p class='summary'>{html.escape(explorer.summary)}</p>"
        f"<section class='controls'>{controls}<div class='downloads'>"
        f"<a id='download-png' class='button' download='{explorer.name}.png' href='/api/{explorer.name}/download.png?{query}'>PNG</a>"
        f"<a id='download-json' class='button' download='{explorer.name}.json' href='/api/{explorer.name}/download.json?{query}'>numbers (JSON)</a>"
        "</div><p id='status' role='status'></p></section>"
        "<div id='figure'></div>"
        f"<section class='equations'>{equations}</section></main>"
        "<script src='/static/plotly.min.js'></script><script src='/static/app.js'></script>"
    )
    return _page(f"{explorer.name} · rlalign explorers", body)


# ---------------------------------------------------------------- data


def figure_endpoint(request: Request) -> JSONResponse:
    explorer, params, result, seconds, figure_keywords = _result(request)
    figure = to_jsonable(explorer.load().figure(result, **figure_keywords))
    compute_ms = None if seconds is None else round(1000 * seconds, 2)
    return JSONResponse({"name": explorer.name, "params": params, "cached": seconds is None, "compute_ms": compute_ms, "figure": figure})


def download_png(request: Request) -> Response:
    explorer, _, result, _, figure_keywords = _result(request)
    buffer = io.BytesIO()
    with _render_lock:
        explorer.load().plot(result, buffer, **figure_keywords)
    return Response(buffer.getvalue(), media_type="image/png", headers={"Content-Disposition": f'attachment; filename="{explorer.name}.png"'})


def download_json(request: Request) -> Response:
    explorer, params, result, _, _ = _result(request)
    text = json.dumps({"explorer": explorer.name, "params": params, "result": to_jsonable(result)}, indent=1) + "\n"
    return Response(text, media_type="application/json", headers={"Content-Disposition": f'attachment; filename="{explorer.name}.json"'})


def equation(request: Request) -> Response:
    explorer, index = _explorer(request), request.path_params["index"]
    if not 0 <= index < len(explorer.equations):
        raise HTTPException(404, f"{explorer.name} has {len(explorer.equations)} equations")
    return Response(_equation_svg(explorer.name, index), media_type="image/svg+xml")


def plotly_js(request: Request) -> FileResponse:
    return FileResponse(PLOTLY_JS, media_type="text/javascript")


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    return _error(getattr(exc, "status_code", 400), str(getattr(exc, "detail", exc)), getattr(exc, "headers", None))


async def _param_error(request: Request, exc: Exception) -> JSONResponse:
    return _error(400, str(exc))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return _error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")


def create_app(allowed_hosts: list[str] | None = None) -> Starlette:
    """The app; ``allowed_hosts`` are the Host header values it answers (default: this machine's loopback names)."""
    allowed_hosts = allowed_hosts or [LOOPBACK, "localhost", "[::1]"]
    routes = [
        Route("/", index),
        Route("/explorer/{name}", explorer_page),
        Route("/api/{name}/figure", figure_endpoint),
        Route("/api/{name}/download.png", download_png),
        Route("/api/{name}/download.json", download_json),
        Route("/equation/{name}/{index:int}.svg", equation),
        Route("/static/plotly.min.js", plotly_js),
        Mount("/static", StaticFiles(directory=STATIC_DIR)),
    ]
    handlers = {HTTPException: _http_error, ParamError: _param_error, Exception: _internal_error}
    return Starlette(routes=routes, exception_handlers=handlers,
                     middleware=[Middleware(SecurityHeaders), Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)])


def allowed_hosts(host: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The Host header names the app answers when listening on ``host``: the loopback names, ``host`` itself,
    and for a wildcard address (0.0.0.0, ::) this machine's name and addresses; plus ``extra`` (--allow-host).
    Any other name is refused, so a web page elsewhere cannot reach the server by DNS rebinding."""
    names = {LOOPBACK, "localhost", "[::1]", *extra}
    if host not in (LOOPBACK, "localhost", "::1"):
        names.add(f"[{host}]" if ":" in host else host)
    if host in ("0.0.0.0", "::", ""):
        machine = socket.gethostname()
        names |= {machine, socket.getfqdn()}
        try:
            names |= set(socket.gethostbyname_ex(machine)[2])
        except OSError:
            pass
    return sorted(names)


def _server(host: str, port: int, warm: bool, allow_hosts: tuple[str, ...] = ()) -> tuple[uvicorn.Server, socket.socket]:
    sock = bound_socket(host, port)
    if warm:
        threading.Thread(target=warm_up, daemon=True).start()
    app = create_app(allowed_hosts(host, allow_hosts))
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)), sock


def serve(host: str = LOOPBACK, port: int = 8050, on_ready: Callable[[str], None] | None = None, warm: bool = True,
          allow_hosts: tuple[str, ...] = ()) -> None:
    """Serve until interrupted; ``on_ready(url)`` runs once the socket is bound; ``allow_hosts``: more Host names to answer."""
    server, sock = _server(host, port, warm, allow_hosts)
    if on_ready is not None:
        on_ready(base_url(host, sock.getsockname()[1]))
    server.run(sockets=[sock])


def start_in_thread(host: str = LOOPBACK, port: int = 0, warm: bool = False) -> tuple[str, Callable[[], None]]:
    """Start the server on a background thread (port 0: a free one); returns (base URL, stop)."""
    server, sock = _server(host, port, warm)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the explorer server did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return base_url(host, sock.getsockname()[1]), stop
