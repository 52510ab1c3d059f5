"""``rlalign explore NAME [--out DIR]``, ``rlalign explore all``, ``rlalign explore --list``.

Writes ``DIR/NAME.png`` and ``DIR/NAME.json`` (the numbers behind the figure) for one explorer or
for all of them. The explorers run on one CPU thread; each takes a few seconds.
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


def run(args: argparse.Namespace) -> int:
    if args.list:
        width = max(map(len, EXPLORERS))
        for name, explorer in EXPLORERS.items():
            print(f"{name:<{width}}  {explorer.summary}  [{explorer.seed_name}]")
        return 0
    if args.name is None:
        print("rlalign explore: give an explorer NAME, 'all', or --list", file=sys.stderr)
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
