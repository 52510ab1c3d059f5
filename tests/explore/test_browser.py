"""The live explorer page in a real browser: headless Chromium (the distribution's) driven by Playwright.

For every explorer: the page loads with no console error; moving its first slider with the keyboard
redraws the figure with the numbers ``compute()`` gives for the new value (read back from plotly's
data on the page); the download links carry the new values; a screenshot is taken and is not blank.
No browser is downloaded: without a Chromium on this machine these tests skip, naming why.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from urllib.parse import parse_qsl

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the explore extra is not installed: pip install 'rlalign[explore]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra has it)")

from rlalign.explore._common import to_jsonable  # noqa: E402
from rlalign.explore.params import keywords, parse_params  # noqa: E402
from rlalign.explore.registry import EXPLORERS  # noqa: E402
from rlalign.explore.server import start_in_thread  # noqa: E402

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("RLALIGN_CHROMIUM") or next(
    (path for path in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if path), None)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
if CHROMIUM is None:
    pytest.skip("no Chromium on this machine (make test installs the distribution's chromium where it can): browser tests skipped",
                allow_module_level=True)

READY = "#explorer[data-state=ready]"


@pytest.fixture(scope="module")
def server_url():
    url, stop = start_in_thread()
    yield url
    stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.problems = []  # console errors, uncaught exceptions and failed requests
    page.on("console", lambda message: message.type == "error" and page.problems.append(f"console: {message.text}"))
    page.on("pageerror", lambda error: page.problems.append(f"page error: {error}"))
    page.on("requestfailed", lambda request: page.problems.append(f"request failed: {request.url}"))
    page.on("response", lambda response: response.status >= 400 and page.problems.append(f"HTTP {response.status}: {response.url}"))
    yield page
    context.close()


def plotted(page) -> dict:
    """What plotly holds on the page: the traces with their numeric arrays, the shapes and the panel titles."""
    text = page.evaluate("""() => {
        const gd = document.getElementById('figure');
        return JSON.stringify({
            data: gd.data.map(t => ({name: t.name, x: t.x, y: t.y, z: t.z, base: t.base})),
            shapes: (gd.layout.shapes || []).map(s => [s.x0, s.x1, s.y0, s.y1]),
            titles: (gd.layout.annotations || []).map(a => a.text),
        });
    }""")
    return json.loads(text)


def expected(name: str, query: str) -> dict:
    """The figure that rlalign computes for the values in ``query``, in the form of :func:`plotted`."""
    explorer = EXPLORERS[name]
    values = parse_params(explorer.params, dict(parse_qsl(query, keep_blank_values=True)))
    module = explorer.load()
    result = module.compute(**keywords(explorer.params, values, "compute"))
    figure = to_jsonable(module.figure(result, **keywords(explorer.params, values, "figure")))
    return {"data": figure["data"], "shapes": [[s["x0"], s["x1"], s["y0"], s["y1"]] for s in figure["layout"].get("shapes", [])],
            "titles": [a["text"] for a in figure["layout"].get("annotations", [])]}


def assert_same_figure(page_figure: dict, computed: dict) -> None:
    np.testing.assert_allclose(np.asarray(page_figure["shapes"], dtype=float), np.asarray(computed["shapes"], dtype=float), rtol=1e-12)
    assert page_figure["titles"] == computed["titles"]
    shown = page_figure["data"]
    assert [t["name"] for t in shown] == [t["name"] for t in computed["data"]]
    for a, b in zip(shown, computed["data"]):
        for key in ("x", "y", "z", "base"):
            if b.get(key) is None:
                continue
            left, right = np.asarray(a[key], dtype=object), np.asarray(b[key], dtype=object)
            if left.dtype == object and any(isinstance(v, str) for v in left.ravel()):
                assert left.tolist() == right.tolist(), (a["name"], key)
            else:
                np.testing.assert_allclose(np.asarray(a[key], dtype=float), np.asarray(b[key], dtype=float), rtol=1e-12, atol=1e-12,
                                           err_msg=f"{a['name']}.{key}")


def slider_value_after_keys(page, name: str, key: str, presses: int) -> str:
    slider = page.locator(f"input[type=range][name={name}]")
    slider.focus()
    for _ in range(presses):
        page.keyboard.press(key)
    return slider.input_value()


@pytest.mark.parametrize("name", list(EXPLORERS))
def test_page_slider_and_screenshot(page, server_url, name, tmp_path):
    explorer = EXPLORERS[name]
    page.goto(f"{server_url}/explorer/{name}")
    page.wait_for_selector(READY, timeout=60_000)
    root = page.locator("#explorer")
    before = root.get_attribute("data-query")
    assert_same_figure(plotted(page), expected(name, before))

    slider = next(p for p in explorer.params if p.kind != "choice")
    key = "ArrowLeft" if slider.default + 2 * slider.step > slider.high else "ArrowRight"
    page.evaluate("() => { delete document.getElementById('explorer').dataset.latencyMs; }")
    value = slider_value_after_keys(page, slider.name, key, 2)
    assert float(value) != float(slider.default)
    # the page sets data-latency-ms once the figure drawn is that of the controls' current values
    # (wait_for_function polls with eval, which the page's CSP forbids: wait for the state by selector)
    page.wait_for_selector("#explorer[data-state=ready][data-latency-ms]", timeout=60_000)
    after = root.get_attribute("data-query")
    assert dict(parse_qsl(after))[slider.name] == value
    assert_same_figure(plotted(page), expected(name, after))
    assert expected(name, after) != expected(name, before), "moving the slider changed nothing on the page"
    assert page.locator(f"output[for=p-{slider.name}]").text_content() == value
    assert float(root.get_attribute("data-latency-ms")) > 0

    for link, kind in (("#download-png", "image/png"), ("#download-json", "application/json")):
        href = page.locator(link).get_attribute("href")
        assert href.endswith(after)
        response = page.request.get(server_url + href)
        assert response.ok and response.headers["content-type"] == kind
    assert page.locator(".equation img").count() == len(explorer.equations)
    assert all(page.evaluate("() => Array.from(document.querySelectorAll('.equation img')).map(i => i.naturalWidth > 0)"))

    shot = page.locator("#figure").screenshot(path=str(tmp_path / f"{name}.png"))
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(shot)).convert("RGB")).reshape(-1, 3)
    assert pixels.shape[0] > 200_000
    assert (pixels.min(axis=1) < 200).mean() > 0.01, "the figure's screenshot is blank"
    assert len(np.unique(pixels, axis=0)) > 30, "the figure's screenshot has hardly any colours"
    assert page.problems == [], page.problems


def test_selector_changes_the_figure(page, server_url):
    page.goto(f"{server_url}/explorer/kl-penalty-tradeoff")
    page.wait_for_selector(READY, timeout=60_000)
    page.evaluate("() => { delete document.getElementById('explorer').dataset.latencyMs; }")
    page.select_option("select[name=beta]", "2.5")
    page.wait_for_selector("#explorer[data-state=ready][data-latency-ms]", timeout=60_000)
    assert dict(parse_qsl(page.locator("#explorer").get_attribute("data-query")))["beta"] == "2.5"
    assert page.locator("#status").text_content() == "from the cache"  # a figure-stage control recomputes nothing
    shown = plotted(page)
    assert_same_figure(shown, expected("kl-penalty-tradeoff", page.locator("#explorer").get_attribute("data-query")))
    assert "β = 2.5" in [t["name"] for t in shown["data"]]
    assert page.problems == [], page.problems


def test_maze_policy_selector_recomputes_the_values_of_pi(page, server_url):
    page.goto(f"{server_url}/explorer/maze-values")
    page.wait_for_selector(READY, timeout=60_000)
    page.evaluate("() => { delete document.getElementById('explorer').dataset.latencyMs; }")
    page.select_option("select[name=policy]", "greedy")
    page.wait_for_selector("#explorer[data-state=ready][data-latency-ms]", timeout=60_000)
    query = page.locator("#explorer").get_attribute("data-query")
    assert dict(parse_qsl(query))["policy"] == "greedy"
    assert page.locator("#status").text_content().startswith("computed in")  # a compute-stage control: a new result
    shown = plotted(page)
    assert_same_figure(shown, expected("maze-values", query))
    v_pi = next(t for t in shown["data"] if t["name"] == "V^π")["z"]
    np.testing.assert_allclose(v_pi, [[8.1, 9.0, 0.0], [9.0, 10.0, 0.0]], atol=1e-12)  # V^{pi*} = V*
    assert page.problems == [], page.problems


def test_index_links_to_every_explorer(page, server_url):
    page.goto(server_url)
    links = page.locator("#explorers a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert links == [f"/explorer/{name}" for name in EXPLORERS]
    assert page.problems == [], page.problems
