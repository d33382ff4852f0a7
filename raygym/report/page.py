"""The report's HTML page: inline styles, the page data as inline JSON, and an inline script that draws
the tables, the SVG charts and the trace browser from it. Nothing is fetched: no CDN, no fonts, no
images. Each section sets ``data-rendered="true"`` once drawn (the browser test waits for that)."""

from __future__ import annotations

import html
import json
from typing import Any

STYLE = """
:root { --fg:#1d2330; --muted:#5f6b7a; --line:#d9dee5; --bg:#f6f7f9; --card:#fff; --accent:#2f6fde; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; color:var(--fg); background:var(--bg); }
header { padding:18px 28px; background:var(--card); border-bottom:1px solid var(--line); }
header h1 { margin:0 0 4px; font-size:20px; }
header .meta { color:var(--muted); font-size:12px; }
nav a { margin-right:14px; color:var(--accent); text-decoration:none; font-size:13px; }
main { padding:8px 28px 40px; }
section { margin-top:22px; }
section h2 { font-size:16px; margin:0 0 10px; }
.note { color:var(--muted); font-size:12px; margin:4px 0 10px; }
table { border-collapse:collapse; background:var(--card); width:100%; font-size:13px; }
th, td { border:1px solid var(--line); padding:5px 8px; text-align:left; vertical-align:top; }
th { background:#eef1f5; font-weight:600; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
.swatch { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:6px; vertical-align:middle; }
.grid { display:grid; grid-template-columns:repeat(auto-fill,minmax(430px,1fr)); gap:14px; }
.chart { background:var(--card); border:1px solid var(--line); border-radius:6px; padding:10px 12px; position:relative; }
.chart h3 { margin:0 0 6px; font-size:13px; }
.chart svg { width:100%; height:auto; display:block; }
.chart .empty { color:var(--muted); font-size:12px; padding:30px 0; text-align:center; }
.legend { font-size:11px; color:var(--muted); margin-top:6px; }
.legend span.item { margin-right:10px; white-space:nowrap; }
.legend svg { width:22px; height:8px; display:inline; vertical-align:middle; margin-right:4px; }
.tip { position:absolute; pointer-events:none; background:rgba(29,35,48,.92); color:#fff; font-size:11px;
       padding:5px 7px; border-radius:4px; white-space:nowrap; display:none; z-index:2; }
.controls { display:flex; flex-wrap:wrap; gap:10px; align-items:center; margin-bottom:8px; font-size:13px; }
.controls select, .controls input { font:inherit; padding:3px 6px; border:1px solid var(--line); border-radius:4px; }
pre.text { margin:0; white-space:pre-wrap; word-break:break-word; font:12px/1.4 ui-monospace,Menlo,Consolas,monospace; max-height:9em; overflow:auto; }
button { font:inherit; margin-top:8px; padding:4px 12px; border:1px solid var(--line); border-radius:4px; background:var(--card); cursor:pointer; }
.diff td.changed { background:#fff6db; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var PALETTE = ["#2f6fde", "#e4572e", "#29a36a", "#9b5de5", "#f3a712", "#0fb5ae", "#d1495b", "#6c757d"];
  var DASHES = ["", "6 3", "2 3", "8 3 2 3", "1 3", "10 4"];
  var SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, parent, text) {
    var node = document.createElement(tag);
    for (var k in (attrs || {})) node.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (parent) parent.appendChild(node);
    return node;
  }
  function svg(tag, attrs, parent) {
    var node = document.createElementNS(SVG, tag);
    for (var k in (attrs || {})) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmt(v, unit) {
    if (v === null || v === undefined || typeof v !== "number" || !isFinite(v)) return "—";
    if (unit === "bytes") {
      var units = ["B", "KB", "MB", "GB", "TB"], i = 0, x = Math.abs(v);
      while (x >= 1000 && i < units.length - 1) { x /= 1000; i++; }
      return (v < 0 ? "-" : "") + x.toPrecision(3) + " " + units[i];
    }
    var a = Math.abs(v);
    var text = (a !== 0 && (a < 1e-3 || a >= 1e5)) ? v.toExponential(2) : String(+v.toPrecision(4));
    return unit === "s" ? text + " s" : text;
  }
  function color(run) { return PALETTE[run % PALETTE.length]; }
  function done(id) { document.getElementById(id).setAttribute("data-rendered", "true"); }

  function renderRuns() {
    var box = document.getElementById("runs-body");
    var t = el("table", {}, box), head = el("tr", {}, el("thead", {}, t)), body = el("tbody", {}, t);
    ["run", "model", "steps", "reward first → last", "last eval reward", "time", "traces", "path"].forEach(function (h) { el("th", {}, head, h); });
    data.runs.forEach(function (r, i) {
      var tr = el("tr", {}, body), name = el("td", {}, tr);
      el("span", {"class": "swatch", style: "background:" + color(i)}, name);
      name.appendChild(document.createTextNode(r.name));
      el("td", {}, tr, r.model);
      el("td", {"class": "num"}, tr, r.steps + (r.planned_steps ? " / " + r.planned_steps : ""));
      el("td", {"class": "num"}, tr, fmt(r.reward_first) + " → " + fmt(r.reward_last));
      var evals = Object.keys(r.eval_last).map(function (k) { return k + " " + fmt(r.eval_last[k]); });
      el("td", {}, tr, evals.length ? evals.join(", ") : "—");
      el("td", {"class": "num"}, tr, fmt(r.time_s, "s"));
      el("td", {"class": "num"}, tr, r.traces);
      el("td", {}, tr, r.path);
    });
    done("runs");
  }

  function renderConfig() {
    var box = document.getElementById("config-body"), cfg = data.config;
    el("p", {"class": "note"}, box, cfg.single
      ? "Fields of this run that differ from the Recipe() defaults."
      : "Fields whose values differ between the runs (" + cfg.rows.length + ").");
    if (!cfg.rows.length) { el("p", {"class": "note"}, box, "No differences."); done("config"); return; }
    var t = el("table", {"class": "diff"}, box), head = el("tr", {}, el("thead", {}, t)), body = el("tbody", {}, t);
    el("th", {}, head, "field");
    data.runs.forEach(function (r) { el("th", {}, head, r.name); });
    if (cfg.single) el("th", {}, head, "default");
    cfg.rows.forEach(function (row) {
      var tr = el("tr", {}, body);
      el("td", {}, tr, row.field);
      row.values.forEach(function (v) { el("td", {"class": "changed"}, tr, v); });
      if (cfg.single) el("td", {}, tr, row.default === null ? "—" : row.default);
    });
    done("config");
  }

  function niceTicks(lo, hi, n, integer) {
    if (lo === hi) { lo -= 1; hi += 1; }
    var step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    var err = (hi - lo) / n / step;
    step *= err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1;
    if (integer) step = Math.max(1, Math.round(step));
    var ticks = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
    return ticks;
  }

  function drawChart(card, chart) {
    var series = chart.series;
    if (!series.length) { el("div", {"class": "empty"}, card, "no data in these runs"); return; }
    var W = 460, H = 250, L = 58, R = 12, T = 10, B = 30;
    var xs = [], ys = [];
    series.forEach(function (s) { s.points.forEach(function (p) { xs.push(p[0]); ys.push(p[1]); }); });
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    var y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    var pad = (y1 - y0) * 0.06 || Math.abs(y1) * 0.1 || 1;
    y0 -= pad; y1 += pad;
    var sx = function (x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
    var sy = function (y) { return T + (1 - (y - y0) / (y1 - y0)) * (H - T - B); };
    var root = svg("svg", {viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": chart.title}, card);
    niceTicks(y0, y1, 5).forEach(function (v) {
      svg("line", {x1: L, x2: W - R, y1: sy(v), y2: sy(v), stroke: "#e6e9ee"}, root);
      svg("text", {x: L - 6, y: sy(v) + 4, "text-anchor": "end", "font-size": 10, fill: "#5f6b7a"}, root).textContent = fmt(v, chart.unit);
    });
    niceTicks(x0, x1, 6, true).forEach(function (v) {
      svg("text", {x: sx(v), y: H - B + 16, "text-anchor": "middle", "font-size": 10, fill: "#5f6b7a"}, root).textContent = String(v);
    });
    svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#9aa4b1"}, root);
    svg("text", {x: (L + W - R) / 2, y: H - 2, "text-anchor": "middle", "font-size": 10, fill: "#5f6b7a"}, root).textContent = "step";
    var keys = [];
    series.forEach(function (s) { if (keys.indexOf(s.key) < 0) keys.push(s.key); });
    series.forEach(function (s) {
      var d = s.points.map(function (p, i) { return (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1); }).join(" ");
      var attrs = {d: d, fill: "none", stroke: color(s.run), "stroke-width": 1.6, "data-key": s.key};
      var dash = DASHES[keys.indexOf(s.key) % DASHES.length];
      if (dash) attrs["stroke-dasharray"] = dash;
      svg("path", attrs, root);
      if (s.points.length === 1) svg("circle", {cx: sx(s.points[0][0]), cy: sy(s.points[0][1]), r: 3, fill: color(s.run)}, root);
    });
    var cursor = svg("line", {y1: T, y2: H - B, stroke: "#9aa4b1", "stroke-dasharray": "3 3", visibility: "hidden"}, root);
    var tip = el("div", {"class": "tip"}, card);
    root.addEventListener("mousemove", function (ev) {
      var box = root.getBoundingClientRect();
      var x = x0 + ((ev.clientX - box.left) / box.width * W - L) / (W - L - R) * (x1 - x0);
      var best = null;
      xs.forEach(function (v) { if (best === null || Math.abs(v - x) < Math.abs(best - x)) best = v; });
      var lines = ["step " + best];
      series.forEach(function (s) {
        s.points.forEach(function (p) { if (p[0] === best) lines.push((data.runs.length > 1 ? data.runs[s.run].name + " · " : "") + s.key + ": " + fmt(p[1], chart.unit)); });
      });
      cursor.setAttribute("x1", sx(best)); cursor.setAttribute("x2", sx(best)); cursor.setAttribute("visibility", "visible");
      tip.textContent = ""; lines.forEach(function (line) { el("div", {}, tip, line); });
      tip.style.display = "block";
      tip.style.left = Math.min(ev.clientX - card.getBoundingClientRect().left + 12, card.clientWidth - tip.offsetWidth - 4) + "px";
      tip.style.top = (ev.clientY - card.getBoundingClientRect().top + 12) + "px";
    });
    root.addEventListener("mouseleave", function () { tip.style.display = "none"; cursor.setAttribute("visibility", "hidden"); });
    var legend = el("div", {"class": "legend"}, card);
    series.forEach(function (s) {
      var item = el("span", {"class": "item"}, legend);
      var icon = svg("svg", {viewBox: "0 0 22 8"}, item);
      var attrs = {x1: 0, x2: 22, y1: 4, y2: 4, stroke: color(s.run), "stroke-width": 2};
      var dash = DASHES[keys.indexOf(s.key) % DASHES.length];
      if (dash) attrs["stroke-dasharray"] = dash;
      svg("line", attrs, icon);
      item.appendChild(document.createTextNode((data.runs.length > 1 ? data.runs[s.run].name + " · " : "") + s.key));
    });
  }

  function renderCharts() {
    var grid = document.getElementById("charts");
    data.charts.forEach(function (chart) {
      var card = el("div", {"class": "chart", id: "chart-" + chart.id}, grid);
      el("h3", {}, card, chart.title);
      drawChart(card, chart);
    });
    done("curves");
  }

  function renderTraces() {
    var box = document.getElementById("traces-body"), traces = data.traces, PAGE = 50, limit = PAGE;
    var controls = el("div", {"class": "controls"}, box);
    function select(label, options) {
      var wrap = el("label", {}, controls, label + " ");
      var s = el("select", {}, wrap);
      options.forEach(function (o) { el("option", {value: o[0]}, s, o[1]); });
      return s;
    }
    var runSel = select("run", [["", "all"]].concat(data.runs.map(function (r, i) { return [String(i), r.name]; })));
    var sources = [];
    traces.forEach(function (t) { if (sources.indexOf(t.source) < 0) sources.push(t.source); });
    var srcSel = select("source", [["", "all"]].concat(sources.map(function (s) { return [s, s]; })));
    var steps = [];
    traces.forEach(function (t) { if (steps.indexOf(t.step) < 0) steps.push(t.step); });
    steps.sort(function (a, b) { return a - b; });
    var stepSel = select("step", [["", "all"]].concat(steps.map(function (s) { return [String(s), String(s)]; })));
    var search = el("input", {type: "search", placeholder: "search prompt / response", size: 28}, controls);
    var count = el("span", {"class": "note"}, controls);
    var t = el("table", {id: "trace-table"}, box), head = el("tr", {}, el("thead", {}, t)), body = el("tbody", {}, t);
    ["run", "source", "step", "reward", "finish", "prompt", "response", "label", "where"].forEach(function (h) { el("th", {}, head, h); });
    var more = el("button", {type: "button"}, box, "show more");
    more.addEventListener("click", function () { limit += PAGE; update(); });
    function update() {
      var q = search.value.toLowerCase(), shown = 0, total = 0;
      body.textContent = "";
      traces.forEach(function (tr) {
        if (runSel.value !== "" && String(tr.run) !== runSel.value) return;
        if (srcSel.value !== "" && tr.source !== srcSel.value) return;
        if (stepSel.value !== "" && String(tr.step) !== stepSel.value) return;
        if (q && (tr.prompt + "\n" + tr.response).toLowerCase().indexOf(q) < 0) return;
        total++;
        if (shown >= limit) return;
        shown++;
        var row = el("tr", {}, body), name = el("td", {}, row);
        el("span", {"class": "swatch", style: "background:" + color(tr.run)}, name);
        name.appendChild(document.createTextNode(data.runs[tr.run].name));
        el("td", {}, row, tr.source);
        el("td", {"class": "num"}, row, tr.step);
        el("td", {"class": "num"}, row, fmt(tr.reward));
        el("td", {}, row, tr.finish);
        el("pre", {"class": "text"}, el("td", {}, row), tr.prompt);
        el("pre", {"class": "text"}, el("td", {}, row), tr.response);
        el("pre", {"class": "text"}, el("td", {}, row), tr.label);
        el("td", {}, row, tr.where);
      });
      count.textContent = total ? "showing " + shown + " of " + total : "no traces match";
      more.style.display = shown < total ? "" : "none";
    }
    function reset() { limit = PAGE; update(); }
    [runSel, srcSel, stepSel].forEach(function (s) { s.addEventListener("change", reset); });
    search.addEventListener("input", reset);
    if (!traces.length) el("p", {"class": "note"}, box, "No traces: train with --capture-trace, or run raygym eval into the run directory.");
    update();
    done("traces");
  }

  renderRuns();
  renderConfig();
  renderCharts();
  renderTraces();
  document.body.setAttribute("data-rendered", "true");
})();
"""


def _embed_json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element (no ``</script>``, no ``<!--``)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e")


def render_page(data: dict[str, Any], title: str, refresh_s: float | None = None) -> str:
    """The whole HTML document for the page ``data`` (see :func:`raygym.report.build.report_data`)."""
    refresh = f'<meta http-equiv="refresh" content="{max(1, round(refresh_s))}">' if refresh_s else ""
    watching = (f" · refreshes every {max(1, round(refresh_s))} s while the runs train" if refresh_s else "")
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{refresh}
<title>{html.escape(title)}</title>
<style>{STYLE}</style>
</head>
<body>
<header>
<h1>{html.escape(title)}</h1>
<div class="meta">generated {html.escape(data["generated"])} by raygym report{html.escape(watching)}</div>
<nav><a href="#runs">runs</a><a href="#config">config differences</a><a href="#curves">curves</a><a href="#traces">traces</a></nav>
</header>
<main>
<section id="runs"><h2>Runs</h2><div id="runs-body"></div></section>
<section id="config"><h2>Config differences</h2><div id="config-body"></div></section>
<section id="curves"><h2>Curves</h2><div class="grid" id="charts"></div></section>
<section id="traces"><h2>Sampled traces</h2><div id="traces-body"></div></section>
</main>
<script type="application/json" id="report-data">{_embed_json(data)}</script>
<script>{SCRIPT}</script>
</body>
</html>
"""


__all__ = ["render_page"]
