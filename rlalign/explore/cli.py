"""``rlalign explore NAME [--out DIR]``, ``rlalign explore all``, ``rlalign explore --list``,
``rlalign explore --serve [--port PORT] [--host HOST]``.

Writes ``DIR/NAME.png`` and ``DIR/NAME.json`` (the numbers behind the figure) for one explorer or
for all of them. ``--serve`` starts the live local web page instead (:mod:`rlalign.explore.server`,
the ``explore`` extra). The explorers run on one CPU thread.
"""

from __future__ import annotations

import argparse
import sys
import time

from rlalign.explore.registry import EXPLORERS, run_explorer

DEFAULT_OUT = "outputs/explore"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME", help=f"an explorer, or 'all': {', '.join(EXPLORERS)}")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument("--list", action="store_true", help="list the explorers with a one-line description and exit")
    parser.add_argument("--serve", action="store_true", help="serve the explorers as live web pages with sliders (needs rlalign[explore])")
    parser.add_argument("--port", type=int, default=8050, help="port for --serve (default: 8050; 0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address for --serve (default: 127.0.0.1, this machine only; another address exposes the page to the network)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="with --host: one more host name the page may be reached by (repeatable); others are refused")


def run(args: argparse.Namespace) -> int:
    if args.list:
        width = max(map(len, EXPLORERS))
        for name, explorer in EXPLORERS.items():
            print(f"{name:<{width}}  {explorer.summary}  [{explorer.seed_name}]")
        return 0
    if args.serve:
        return _serve(args)
    if args.name is None:
        print("rlalign explore: give an explorer NAME, 'all', --list or --serve", file=sys.stderr)
        return 2
    names = list(EXPLORERS) if args.name == "all" else [args.name]
    unknown = [n for n in names if n not in EXPLORERS]
    if unknown:
        print(f"rlalign explore: unknown explorer {unknown[0]!r}; choose one of: all, {', '.join(EXPLORERS)}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)  # the problems are tiny; one thread is fastest and leaves the machine free
    for name in names:
        start = time.perf_counter()
        png, data = run_explorer(name, args.out)
        print(f"{name}: {png} {data} ({time.perf_counter() - start:.1f} s)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.name is not None:
        print("rlalign explore: --serve serves every explorer; give no NAME with it", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"rlalign explore: --port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    from rlalign.explore.server import LOOPBACK, serve

    def ready(url: str) -> None:
        if args.host not in (LOOPBACK, "localhost", "::1"):
            print(f"rlalign explore: listening on {args.host}, reachable from other machines", file=sys.stderr)
        print(f"rlalign explore: {len(EXPLORERS)} explorers at {url}/ (Ctrl-C to stop)", flush=True)

    serve(args.host, args.port, on_ready=ready, allow_hosts=tuple(args.allow_host))
    return 0
