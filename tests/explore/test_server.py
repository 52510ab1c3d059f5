"""The live explorer app without a browser: parameter checks, the figures' numbers, every route, and its safety.

The figure of every explorer is checked against the numbers its ``compute()`` returns; the app is
driven through Starlette's test client, so a request's answer is checked as the page receives it.
"""

from __future__ import annotations

import inspect
import io
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("starlette", reason="the explore extra is not installed: pip install 'rlalign[explore]'")
from starlette.testclient import TestClient  # noqa: E402

from rlalign.explore import baseline_variance, entropy_collapse, gae_sweep, grpo_advantage, kl_divergence, kl_penalty  # noqa: E402
from rlalign.explore import maze_values, per_token_ratio, ppo_loss, ppo_surrogates  # noqa: E402
from rlalign.explore._common import to_jsonable  # noqa: E402
from rlalign.explore.params import Param, ParamError, defaults, keywords, parse_params  # noqa: E402
from rlalign.explore.registry import EXPLORERS  # noqa: E402
from rlalign.explore.server import create_app  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(), base_url="http://127.0.0.1:8050", raise_server_exceptions=False) as test_client:
        yield test_client


def live_figure(name: str, **values) -> tuple[object, dict]:
    """(result, figure JSON) of explorer ``name`` at its page defaults updated with ``values``, computed directly."""
    explorer = EXPLORERS[name]
    parsed = parse_params(explorer.params, {k: str(v) for k, v in values.items()})
    module = explorer.load()
    result = module.compute(**keywords(explorer.params, parsed, "compute"))
    return result, to_jsonable(module.figure(result, **keywords(explorer.params, parsed, "figure")))


def trace_named(figure: dict, name: str) -> dict:
    matches = [t for t in figure["data"] if t.get("name") == name]
    assert len(matches) == 1, f"{len(matches)} traces named {name!r}: {[t.get('name') for t in figure['data']]}"
    return matches[0]


# ---------------------------------------------------------------- parameters


def test_param_parsing_by_hand():
    params = (Param("eps", "ε", 0.2, 0.05, 0.5, 0.01), Param("steps", "steps", 100, 50, 1500, 50, kind="int"),
              Param("scale", "scale", "group", kind="choice", choices=("group", "none")))
    assert parse_params(params, {}) == {"eps": 0.2, "steps": 100, "scale": "group"}
    assert parse_params(params, {"eps": "0.30000000000000004", "steps": "150", "scale": "none"}) == {"eps": 0.3, "steps": 150, "scale": "none"}
    assert isinstance(parse_params(params, {"steps": "150.0"})["steps"], int)
    bad = {
        ("eps", "0.6"): "out of range; it must be a number from 0.05 to 0.5 in steps of 0.01",
        ("eps", "0.123"): "out of range",  # off the slider's grid
        ("eps", "nan"): "out of range",
        ("eps", "inf"): "out of range",
        ("eps", "abc"): "'abc' is not a number",
        ("eps", ""): "is not a number",
        ("steps", "75"): "a whole number from 50 to 1500 in steps of 50",
        ("scale", "batch"): "must be one of group, none",
        ("epsilon", "0.2"): "unknown parameter 'epsilon'; this explorer takes: eps, steps, scale",
    }
    for (name, text), message in bad.items():
        with pytest.raises(ParamError, match=message.replace("(", r"\(")):
            parse_params(params, {name: text})


def test_param_declarations_are_checked():
    with pytest.raises(ValueError, match="outside"):
        Param("x", "x", 2.0, 0.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="grid"):
        Param("x", "x", 0.15, 0.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="whole"):
        Param("n", "n", 2, 0, 10, 0.5, kind="int")
    with pytest.raises(ValueError, match="not one of"):
        Param("c", "c", "x", kind="choice", choices=("a", "b"))


@pytest.mark.parametrize("name", list(EXPLORERS))
def test_every_param_is_a_keyword_of_compute_or_of_figure_and_plot(name):
    explorer = EXPLORERS[name]
    module = explorer.load()
    compute_args = inspect.signature(module.compute).parameters
    figure_args, plot_args = inspect.signature(module.figure).parameters, inspect.signature(module.plot).parameters
    assert explorer.params and explorer.equations
    for p in explorer.params:
        if p.stage == "compute":
            assert p.name in compute_args, f"{name}: {p.name} is not a keyword of compute()"
        else:
            assert p.name in figure_args and p.name in plot_args, f"{name}: {p.name} is not a keyword of figure() and plot()"
    assert len({p.name for p in explorer.params}) == len(explorer.params)


# ---------------------------------------------------------------- every figure plots the computed numbers


def _close(actual, expected) -> None:
    np.testing.assert_allclose(np.asarray(actual, dtype=float), np.asarray(to_jsonable(expected), dtype=float), rtol=1e-12, atol=1e-12)


def test_ppo_loss_figure():
    res, fig = live_figure("ppo-loss-decomposition", eps=0.3, advantage=2.0)
    assert res.eps == 0.3 and res.advantages.tolist() == [2.0, -2.0]
    _close(trace_named(fig, "L^CLIP, A = +2")["y"], res.objective[0])
    _close(trace_named(fig, "L^CLIP, A = -2")["y"], res.objective[1])
    _close(trace_named(fig, "r·A, A = -2 (unclipped)")["y"], -2.0 * res.ratio)
    bands = [(s["x0"], s["x1"]) for s in fig["layout"]["shapes"] if s["opacity"] == 0.6]
    assert bands == [(0.7, 1.3), (0.7, 1.3)]  # the trust region [1 - eps, 1 + eps] on both panels


def test_ppo_surrogates_figure():
    res, fig = live_figure("ppo-surrogates", eps=0.1, epochs=20)
    assert res.eps == 0.1
    for name, values in (("E_t[KL(π_old ‖ π_θ)]", res.kl), ("L^CPI = E_t[r_t A_t]", res.cpi),
                         ("L^CLIP = E_t[min(r_t A_t, clip(r_t) A_t)]", res.clip_objective), ("E_t[clip(r_t, 1−ε, 1+ε) A_t]", res.clipped_term)):
        _close(trace_named(fig, name)["y"], values)
        _close(trace_named(fig, name)["x"], res.alpha)


def test_per_token_ratio_figure():
    res, fig = live_figure("per-token-ratio", eps=0.1, seq_len=6)
    assert len(res.tokens) == 6
    ratio = trace_named(fig, "ratio r_t (hatched: clip active, no gradient)")
    _close(np.asarray(ratio["y"]) + ratio["base"], res.ratio)
    assert ratio["marker"]["pattern"]["shape"] == ["/" if c else "" for c in res.clip_active > 0.5]
    _close(trace_named(fig, "clipped min(r_t·A_t, clip(r_t)·A_t)")["y"], res.clipped_objective)
    _close(trace_named(fig, "unclipped r_t·A_t")["y"], res.unclipped)


def test_baseline_variance_figure():
    res, fig = live_figure("baseline-variance", batch_size=4, offset="3")
    assert res.batch_size == 4
    _close(trace_named(fig, "none (Monte Carlo)")["y"], res.mc_variance[0])
    _close(trace_named(fig, "optimal b* (closed form)")["y"], res.exact_variance[2])
    c = list(res.offsets).index(3.0)
    _close(trace_named(fig, "RLOO (leave-one-out): mean ± std")["y"], res.mc_mean[3, c])
    _close(trace_named(fig, "RLOO (leave-one-out): mean ± std")["error_y"]["array"], res.mc_std[3, c])


def test_gae_figure_marks_lambda():
    res, fig = live_figure("gae-lambda-sweep", lam=0.5, gamma=0.99)
    assert res.gamma == 0.99
    biased, exact = [t for t in fig["data"] if t["name"] == "MSE = bias² + variance"]
    _close(biased["y"], res.mse[1])
    _close(exact["y"], res.mse[0])
    _close([t for t in fig["data"] if t["name"] == "variance"][1]["y"], res.variance[0])
    assert {s["x0"] for s in fig["layout"]["shapes"]} == {0.5}
    j = list(res.lambdas).index(0.5)
    assert f"MSE {res.mse[0, j]:.3g}" in fig["layout"]["annotations"][1]["text"]


def test_entropy_figure_compares_no_bonus_with_the_chosen_coefficient():
    res, fig = live_figure("entropy-collapse", coefs=0.2, n_steps=50)
    assert res.coefs.tolist() == [0.0, 0.2]
    _close([t for t in fig["data"] if t["name"] == "c2 = 0.2"][0]["y"], res.entropy[1])
    _close([t for t in fig["data"] if t["name"] == "no bonus (c2 = 0)"][1]["y"], res.expected_reward[0])
    _close(trace_named(fig, "c2 = 0.2: optimum H(softmax(μ/c2))")["y"], [res.target_entropy[1]] * 2)


def test_grpo_advantage_figure():
    res, fig = live_figure("grpo-advantage", scales_group_size=5, n_groups=500)
    _close(trace_named(fig, 'group_advantages(scale="group")')["y"], res.scale_correct['group_advantages(scale="group")'])
    _close(trace_named(fig, 'group_advantages(scale="group")')["x"], [0.2, 0.4, 0.6, 0.8])
    _close(trace_named(fig, "G = 4: correct")["y"], res.adv_correct[1])
    _close(trace_named(fig, "G = 8: sampled")["y"], res.tie_fraction[2])


def test_kl_penalty_figure_shows_the_chosen_beta():
    res, fig = live_figure("kl-penalty-tradeoff", beta="1", n_steps=50)
    i = list(res.betas).index(1.0)
    _close(trace_named(fig, "ascent, k1 in the reward (PPO)")["x"], res.kl["k1 in reward"])
    _close(trace_named(fig, "closed form π* ∝ ref·exp(r/β)")["y"], res.frontier_reward)
    _close(trace_named(fig, "k3 in loss (found)")["y"], res.pi_k3_loss[i])
    _close(trace_named(fig, "β = 1")["x"], [res.kl["k1 in reward"][i], res.kl["k3 in loss"][i]])


def test_kl_divergence_figure():
    res, fig = live_figure("kl-divergence", mode_distance=3.0, n_fit_steps=100)
    _close(trace_named(fig, "target p (bimodal)")["y"], res.p)
    q_forward = [t for t in fig["data"] if t["name"].startswith("argmin KL(p‖q)")][0]
    _close(q_forward["y"], res.q_forward)
    _close(trace_named(fig, "k3: std / KL")["y"], res.estimator_std["k3"] / res.true_kl)


def test_maze_figure_follows_the_sweep_slider():
    res, fig = live_figure("maze-values", sweep=1)
    _close(fig["data"][0]["z"], res.values[1].reshape(2, 3))
    assert fig["data"][0]["z"] == [[0.0, 0.0, 0.0], [0.0, 10.0, 0.0]]  # one sweep: only the cell next to the goal knows
    _, fig3 = live_figure("maze-values", sweep=3)
    assert fig3["data"][0]["z"] == [[8.1, 9.0, 0.0], [9.0, 10.0, 0.0]]  # V* by hand (gamma 0.9), exact at sweep 3
    assert trace_named(fig3, "Q*")["z"][0][3] == pytest.approx(8.1)  # start cell, right
    arrows = [a for a in fig3["layout"]["annotations"] if a.get("showarrow") and a["xref"] == "x"]
    assert len(arrows) == 4  # one greedy arrow per non-terminal cell


def test_maze_figure_follows_the_policy_selector():
    # uniform random pi, gamma 0.9: V^pi = (-900, -1300, 0, 900, 1300, 0) / 439 (tests/classic/test_policy_evaluation.py)
    res, fig = live_figure("maze-values", policy="uniform")
    _close(trace_named(fig, "V^π")["z"], (np.array([-900, -1300, 0, 900, 1300, 0]) / 439).reshape(2, 3))
    _close(trace_named(fig, "A^π = Q^π − V^π")["z"], res.a_pi[[0, 1, 3, 4]])
    assert trace_named(fig, "A^π = Q^π − V^π")["z"][3][3] == pytest.approx(3090 / 439)  # s4, right: 10 - 1300/439
    pi_arrows = [a for a in fig["layout"]["annotations"] if a.get("showarrow") and a["xref"] == "x3"]
    assert len(pi_arrows) == 16  # four equally long arrows per live cell
    # the greedy policy of Q* has V^pi = V* and one arrow per cell
    _, greedy = live_figure("maze-values", policy="greedy")
    _close(trace_named(greedy, "V^π")["z"], [[8.1, 9.0, 0.0], [9.0, 10.0, 0.0]])
    assert len([a for a in greedy["layout"]["annotations"] if a.get("showarrow") and a["xref"] == "x3"]) == 4
    # arrows: right at the start and right again at 1 walks into the trap: V^pi(1) = -10, V^pi(0) = 0.9 * -10
    res, arrows = live_figure("maze-values", policy="arrows", arrow_0="right", arrow_1="right")
    assert trace_named(arrows, "V^π")["z"][0][:2] == [pytest.approx(-9.0), pytest.approx(-10.0)]
    _close(trace_named(arrows, "s0 (start): V^π estimate")["y"], res.mc_v[:, 0])
    assert res.mc_v[-1, 0] == pytest.approx(-9.0)  # deterministic returns: Monte Carlo is exact


# ---------------------------------------------------------------- the app's routes


def test_index_lists_every_explorer(client):
    response = client.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    for name in EXPLORERS:
        assert f"href='/explorer/{name}'" in response.text


@pytest.mark.parametrize("name", list(EXPLORERS))
def test_page_has_a_control_per_param_and_its_equations(client, name):
    explorer = EXPLORERS[name]
    page = client.get(f"/explorer/{name}")
    assert page.status_code == 200
    for p in explorer.params:
        if p.kind == "choice":
            assert f"<select id='p-{p.name}'" in page.text
        else:
            assert (f"id='p-{p.name}' name='{p.name}' data-param min='{p.low:.12g}' max='{p.high:.12g}' step='{p.step:.12g}' "
                    f"value='{p.default:.12g}'") in page.text
    for i in range(len(explorer.equations)):
        svg = client.get(f"/equation/{name}/{i}.svg")
        assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml" and b"<svg" in svg.content
    assert client.get(f"/equation/{name}/{len(explorer.equations)}.svg").status_code == 404
    assert "src='/static/plotly.min.js'" in page.text and "https:" not in page.text  # no CDN


def test_figure_endpoint_equals_compute(client):
    response = client.get("/api/ppo-loss-decomposition/figure", params={"eps": "0.25"})
    assert response.status_code == 200
    body = response.json()
    assert body["params"] == {"eps": 0.25, "advantage": 1.0, "r_max": 2.0}
    assert body["figure"] == json.loads(json.dumps(live_figure("ppo-loss-decomposition", eps=0.25)[1]))


def test_a_shared_link_opens_at_its_values(client):
    page = client.get("/explorer/maze-values", params={"sweep": "2", "gamma": "0.8"})
    assert "name='sweep' data-param min='0' max='30' step='1' value='2'>" in page.text
    assert "name='gamma' data-param min='0.5' max='0.99' step='0.01' value='0.8'>" in page.text
    assert ("href='/api/maze-values/download.png?sweep=2&amp;gamma=0.8&amp;policy=uniform&amp;epsilon=0.2&amp;arrow_0=right&amp;"
            "arrow_1=down&amp;arrow_3=right&amp;arrow_4=right&amp;episodes=2000'") in page.text


def test_figure_stage_controls_recompute_nothing(client):
    first = client.get("/api/gae-lambda-sweep/figure", params={"seed": "7", "lam": "0.3"}).json()
    again = client.get("/api/gae-lambda-sweep/figure", params={"seed": "7", "lam": "0.8"}).json()
    assert first["cached"] is False and first["compute_ms"] > 0
    assert again["cached"] is True and again["compute_ms"] is None
    assert again["figure"]["data"] == first["figure"]["data"]  # the same result, another lambda marked
    assert again["figure"]["layout"]["shapes"][0]["x0"] == 0.8


def test_downloads_are_the_figure_and_numbers_of_the_current_values(client):
    png = client.get("/api/maze-values/download.png", params={"sweep": "2"})
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert "attachment" in png.headers["content-disposition"]
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(png.content)).convert("L"))
    assert image.shape[0] > 300 and (image < 250).mean() > 0.05  # not blank
    data = client.get("/api/maze-values/download.json", params={"gamma": "0.5"}).json()
    assert data["params"] == {"sweep": 1, "gamma": 0.5, "policy": "uniform", "epsilon": 0.2, "arrow_0": "right", "arrow_1": "down",
                              "arrow_3": "right", "arrow_4": "right", "episodes": 2000}
    np.testing.assert_allclose(data["result"]["v_star"], maze_values.compute(gamma=0.5).v_star)


def test_assets_come_from_installed_packages(client):
    for path, kind in (("/static/plotly.min.js", "javascript"), ("/static/app.js", "javascript"), ("/static/app.css", "text/css")):
        response = client.get(path)
        assert response.status_code == 200 and kind in response.headers["content-type"]


# ---------------------------------------------------------------- safety


@pytest.mark.parametrize("path, params, status, message", [
    ("/api/ppo-loss-decomposition/figure", {"eps": "7"}, 400, "eps='7' is out of range; it must be a number from 0.05 to 0.5"),
    ("/api/ppo-loss-decomposition/figure", {"eps": "1e999"}, 400, "out of range"),
    ("/api/ppo-loss-decomposition/figure", {"eps": "<script>"}, 400, "is not a number"),
    ("/api/ppo-loss-decomposition/figure", {"path": "/etc/passwd"}, 400, "unknown parameter 'path'"),
    ("/api/maze-values/download.png", {"sweep": "31"}, 400, "a whole number from 0 to 30"),
    ("/api/kl-penalty-tradeoff/download.json", {"beta": "0.3"}, 400, "must be one of 0.1, 0.15"),
    ("/explorer/gae-lambda-sweep", {"lam": "2"}, 400, "lam='2' is out of range"),
    ("/api/no-such/figure", {}, 404, "unknown explorer 'no-such'"),
    # a repeated name was answered 200 with the last value kept
    ("/api/ppo-loss-decomposition/figure", [("eps", "0.1"), ("eps", "0.3")], 400, "parameter 'eps' is given 2 times; give it once"),
    ("/explorer/maze-values", [("policy", "uniform"), ("policy", "greedy")], 400, "parameter 'policy' is given 2 times"),
    ("/explorer/..%2F..%2Fetc%2Fpasswd", {}, 404, "Not Found"),
    ("/explorer/%2e%2e", {}, 404, "unknown explorer '..'"),
    ("/static/%2e%2e/server.py", {}, 404, "Not Found"),
    ("/static/%2e%2e%2fserver.py", {}, 404, "Not Found"),
    ("/static/..%2f..%2fparams.py", {}, 404, "Not Found"),
    ("/no/such/route", {}, 404, "Not Found"),
])
def test_malformed_requests_get_a_4xx_with_a_message_and_no_traceback(client, path, params, status, message):
    response = client.get(path, params=params)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert message in response.json()["error"]
    assert "Traceback" not in response.text and "File \"" not in response.text


def test_other_methods_and_foreign_hosts_are_refused(client):
    refused = client.post("/api/maze-values/figure")
    assert refused.status_code == 405 and "GET" in refused.headers["allow"]
    assert client.get("/", headers={"host": "evil.example"}).status_code == 400  # DNS rebinding
    assert client.get("/", headers={"host": "localhost:8050"}).status_code == 200


def test_an_internal_error_is_one_line_not_a_traceback(client, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(ppo_loss, "figure", broken)
    response = client.get("/api/ppo-loss-decomposition/figure")
    assert response.status_code == 500
    assert response.json() == {"error": "internal error: RuntimeError: boom"}


def test_allowed_hosts():
    from rlalign.explore.server import allowed_hosts

    assert allowed_hosts("127.0.0.1") == ["127.0.0.1", "[::1]", "localhost"]
    assert "192.0.2.7" in allowed_hosts("192.0.2.7") and "*" not in allowed_hosts("192.0.2.7")
    wildcard = allowed_hosts("0.0.0.0", ("lab.example",))
    assert {socket.gethostname(), "lab.example", "localhost"} <= set(wildcard) and "*" not in wildcard
    app = TestClient(create_app(wildcard), base_url="http://lab.example:8050")
    assert app.get("/").status_code == 200
    assert app.get("/", headers={"host": "evil.example"}).status_code == 400


def test_every_response_carries_the_security_headers(client):
    for path in ("/", "/explorer/maze-values", "/api/maze-values/figure", "/api/no-such/figure", "/static/app.js", "/static/plotly.min.js",
                 "/equation/maze-values/0.svg", "/api/maze-values/download.json"):
        headers = client.get(path).headers
        assert headers["x-content-type-options"] == "nosniff"
        assert "default-src 'self'" in headers["content-security-policy"]


# ---------------------------------------------------------------- the command


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_serve_binds_loopback_and_serves(tmp_path):
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "rlalign", "explore", "--serve", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in line
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/maze-values/figure?sweep=0", timeout=30) as response:
                    assert json.load(response)["params"]["sweep"] == 0
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        if shutil.which("ss"):  # iproute2's ss, where installed: nothing but the loopback address listens
            listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
            assert listening and all(" 127.0.0.1:" in row for row in listening.strip().splitlines()), listening
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_static_path_works_without_the_explore_extra(tmp_path):
    blocked = "import sys; [sys.modules.__setitem__(m, None) for m in ('starlette', 'uvicorn', 'plotly')]; "
    run = subprocess.run([sys.executable, "-c", blocked + "from rlalign.cli import main; sys.exit(main(sys.argv[1:]))",
                          "explore", "maze-values", "--out", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "maze-values.png").stat().st_size > 10_000 and (tmp_path / "maze-values.json").exists()
    served = subprocess.run([sys.executable, "-c", blocked + "from rlalign.cli import main; sys.exit(main(sys.argv[1:]))",
                             "explore", "--serve"], capture_output=True, text=True)
    assert served.returncode == 2
    assert "needs the explore extra" in served.stderr and "pip install 'rlalign[explore]'" in served.stderr


def test_cli_serve_refuses_a_name_and_a_bad_port(capsys):
    from rlalign.cli import main

    assert main(["explore", "maze-values", "--serve"]) == 2
    assert "give no NAME" in capsys.readouterr().err
    assert main(["explore", "--serve", "--port", "70000"]) == 2


def test_explorer_modules_are_the_registered_ones():
    modules = {baseline_variance, entropy_collapse, gae_sweep, grpo_advantage, kl_divergence, kl_penalty, maze_values, per_token_ratio,
               ppo_loss, ppo_surrogates}
    assert {e.load() for e in EXPLORERS.values()} == modules
    assert all(Path(m.__file__).parent.name == "explore" for m in modules)
    assert all(defaults(e.params) for e in EXPLORERS.values())
