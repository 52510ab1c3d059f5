"""Update latency of the live explorer page: from a changed slider value to the new figure drawn.

Starts ``rlalign explore --serve``'s app on a free loopback port, opens every explorer in headless
Chromium (the distribution's, driven by Playwright), and moves each of its sliders one step at a
time with the keyboard, from the page's defaults. Each move is timed by the page itself: from the
``input`` event to the figure redrawn by plotly.js for that value and painted (the next animation
frame), which includes the request, ``compute()`` on the server, the JSON and the redraw. Every move
of a computed parameter asks for values not computed before, so its answer is computed afresh;
selectors and sliders of what is shown (``stage="figure"``: λ marker, maze sweep, β, offset) take
the computed result from the server's cache by design, and are timed too (their compute time is
left out of the compute median).

    .venv/bin/python benchmarks/explore_latency.py [--moves 5] [--out latency.json]

Prints one row per explorer: the median, 90th percentile and largest latency over the moves of the
reader's parameters (epsilon, lambda, beta, G, learning rates, seeds, ...), the median compute,
request and redraw times, the slowest of those sliders, and apart the problem-size sliders (steps,
samples: ``Param.size``), whose larger values cost proportionally more compute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from urllib.parse import parse_qsl

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moves", type=int, default=5, help="moves per slider (default 5)")
    parser.add_argument("--explorers", default="", help="comma-separated names (default: all)")
    parser.add_argument("--out", help="write every measurement as JSON here")
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    from rlalign.explore.registry import EXPLORERS
    from rlalign.explore.server import start_in_thread, warm_up

    chromium = os.environ.get("RLALIGN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no Chromium on this machine: install the distribution's chromium (sh tools/ensure_chromium.sh)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # as `rlalign explore --serve`
    names = [n for n in args.explorers.split(",") if n] or list(EXPLORERS)
    url, stop = start_in_thread()
    warm_up()  # first calls pay for imports and torch's one-time set-up, as the served app does at start
    rows, measurements = [], {}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for name in names:
                page.goto(f"{url}/explorer/{name}")
                page.wait_for_selector("#explorer[data-state=ready]", timeout=120_000)
                per_slider = {}
                for param in EXPLORERS[name].params:
                    if param.kind == "choice":
                        values = [c for c in param.choices if c != param.default][: args.moves]
                        per_slider[param.name] = [_move(page, param.name, lambda v=v: page.select_option(f"select[name={param.name}]", v))
                                                  for v in values]
                        continue
                    room_right = round((param.high - param.default) / param.step)
                    key = "ArrowRight" if room_right >= args.moves else "ArrowLeft"
                    slider = page.locator(f"input[type=range][name={param.name}]")
                    per_slider[param.name] = [_move(page, param.name, lambda: (slider.focus(), page.keyboard.press(key)))
                                              for _ in range(args.moves)]
                    page.goto(f"{url}/explorer/{name}")  # back to the defaults for the next slider
                    page.wait_for_selector("#explorer[data-state=ready]", timeout=120_000)
                measurements[name] = per_slider
                sizes = {p.name for p in EXPLORERS[name].params if p.size}
                reader = [m for p, moves in per_slider.items() if p not in sizes for m in moves]
                sized = [m["latency_ms"] for p, moves in per_slider.items() if p in sizes for m in moves]
                latency = [m["latency_ms"] for m in reader]
                slowest = max((p for p in per_slider if p not in sizes), key=lambda p: statistics.median(m["latency_ms"] for m in per_slider[p]))
                rows.append((name, len(latency), statistics.median(latency), _quantile(latency, 0.9), max(latency),
                             statistics.median(m["compute_ms"] for m in reader if m["compute_ms"] is not None),
                             *(statistics.median(m[f"{key}_ms"] for m in reader) for key in ("fetch", "draw")), slowest,
                             f"{statistics.median(sized):.0f} / {max(sized):.0f}" if sized else "-"))
            browser.close()
    finally:
        stop()
    print("| explorer | moves | median ms | p90 ms | max ms | median: compute / request / redraw ms | slowest slider (median ms) "
          "| problem-size sliders: median / max ms |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for name, n, median, p90, worst, compute, fetch, draw, slowest, sized in rows:
        slow_median = statistics.median(m["latency_ms"] for m in measurements[name][slowest])
        print(f"| {name} | {n} | {median:.0f} | {p90:.0f} | {worst:.0f} | {compute:.0f} / {fetch:.0f} / {draw:.0f} | {slowest} ({slow_median:.0f}) "
              f"| {sized} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(measurements, f, indent=1)
    return 0


def _move(page, name: str, act) -> dict:
    """Do ``act`` (one change of control ``name``), wait for the figure of the new value; the page's timing."""
    root = page.locator("#explorer")
    page.evaluate("() => { delete document.getElementById('explorer').dataset.latencyMs; }")
    act()
    value = page.locator(f"[name={name}][data-param]").input_value()
    # the page sets data-latency-ms only once the figure drawn is that of the controls' current values
    page.wait_for_selector("#explorer[data-state=ready][data-latency-ms]", timeout=120_000)
    assert dict(parse_qsl(root.get_attribute("data-query")))[name] == value
    compute = root.get_attribute("data-compute-ms")
    return {"value": value, "compute_ms": None if compute == "cached" else float(compute),
            **{f"{key}_ms": float(root.get_attribute(f"data-{key}-ms")) for key in ("latency", "fetch", "draw")}}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


if __name__ == "__main__":
    sys.exit(main())
