// The live explorer page: every change of a slider or selector asks the server for the figure at the
// new values (computed by rlalign.core) and redraws it with plotly.js. One request at a time: values
// changed while one is in flight are sent together when it returns, so a dragged slider never queues
// stale work. The page publishes its state on #explorer for tests and the latency benchmark:
// data-state (loading | ready | error), data-query (the values the drawn figure was computed for) and
// data-latency-ms (from the first unanswered change to the figure drawn), split into data-fetch-ms
// (request to parsed answer, compute included) and data-draw-ms (plotly's redraw to the next frame).
"use strict";

(function () {
  const root = document.getElementById("explorer");
  if (!root) return;
  const name = root.dataset.name;
  const figure = document.getElementById("figure");
  const status = document.getElementById("status");
  const controls = Array.from(document.querySelectorAll("[data-param]"));
  const links = { png: document.getElementById("download-png"), json: document.getElementById("download-json") };
  let inFlight = false;
  let dirty = false;
  let changedAt = null; // performance.now() of the oldest change not yet drawn

  function query() {
    const params = new URLSearchParams();
    for (const control of controls) params.set(control.name, control.value);
    return params.toString();
  }

  function showValue(control) {
    const output = control.parentElement.querySelector("output");
    if (output) output.textContent = control.value;
  }

  function nextFrame() {
    return new Promise((resolve) => requestAnimationFrame(() => resolve()));
  }

  async function update() {
    if (inFlight) {
      dirty = true;
      return;
    }
    inFlight = true;
    dirty = false;
    root.dataset.state = "loading";
    const q = query();
    try {
      const requested = performance.now();
      const response = await fetch(`/api/${name}/figure?${q}`);
      const body = await response.json().catch(() => ({}));
      if (!response.ok || !body.figure) throw new Error(body.error || `HTTP ${response.status}`);
      const received = performance.now();
      await Plotly.react(figure, body.figure.data, body.figure.layout, { responsive: true, displaylogo: false });
      await nextFrame();
      root.dataset.fetchMs = (received - requested).toFixed(1);
      root.dataset.drawMs = (performance.now() - received).toFixed(1);
      links.png.href = `/api/${name}/download.png?${q}`;
      links.json.href = `/api/${name}/download.json?${q}`;
      history.replaceState(null, "", `?${q}`);
      root.dataset.query = q;
      root.dataset.computeMs = body.cached ? "cached" : body.compute_ms;
      if (changedAt !== null && q === query()) {
        root.dataset.latencyMs = (performance.now() - changedAt).toFixed(1);
        changedAt = null;
      }
      status.textContent = body.cached ? "from the cache" : `computed in ${body.compute_ms.toFixed(0)} ms`;
      status.classList.remove("error");
      root.dataset.state = "ready";
    } catch (err) {
      status.textContent = String(err.message || err);
      status.classList.add("error");
      root.dataset.state = "error";
      changedAt = null;
    } finally {
      inFlight = false;
      if (dirty || query() !== root.dataset.query) {
        if (root.dataset.state !== "error" || dirty) update();
      }
    }
  }

  for (const control of controls) {
    control.addEventListener("input", () => {
      showValue(control);
      if (changedAt === null) changedAt = performance.now();
      update();
    });
  }
  update();
})();
