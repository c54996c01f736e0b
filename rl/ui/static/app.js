// asyncrl's dashboard (rl/ui): hash-routed pages over the JSON API of rl/ui/server.py.
// Every value from a run (names, recipes, prompts, responses, token strings, verdict reasons, tool output) enters the
// document through textContent or an attribute set by the DOM, never as markup.
"use strict";

const main = document.getElementById("main");
const status = document.getElementById("status");
let timer = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null) continue;
    node.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

async function api(route, params) {
  const q = new URLSearchParams(params || {});
  const r = await fetch(`api/${route}?${q}`, { credentials: "same-origin" });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "-";
  if (typeof v === "number") return digits !== undefined ? v.toFixed(digits) : Number.isInteger(v) ? String(v) : v.toFixed(3);
  return String(v);
}

function route() {
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, query] = hash.split("?");
  return { path, params: new URLSearchParams(query || "") };
}

function show(...nodes) {
  main.replaceChildren(...nodes.flat().filter((n) => n !== null && n !== undefined));
}

function fail(e) {
  show(el("p", { class: "error", id: "error" }, String(e.message || e)));
}

// -- runs ---------------------------------------------------------------------------------------------------------
async function runsPage() {
  const { runs } = await api("runs");
  const rows = runs.map((r) => el("tr", { "data-run": r.key },
    el("td", {}, el("a", { href: `#/curves?runs=${r.key}` }, r.name)),
    el("td", {}, r.stages.join(" -> ")),
    el("td", {}, r.status),
    el("td", { class: "num" }, fmt(r.steps)),
    el("td", { class: "num" }, fmt(r.heldout, 3)),
    el("td", {}, el("a", { href: `#/samples?run=${r.key}` }, "samples")),
    el("td", {}, r.dir)));
  const all = runs.map((r) => r.key).join(",");
  show(el("h2", {}, "Runs"),
    el("table", { id: "runs" },
      el("thead", {}, el("tr", {}, ["name", "stages", "status", "steps", "held-out", "", "directory"].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows)),
    runs.length > 1 ? el("p", {}, el("a", { href: `#/curves?runs=${all}` }, "all runs' curves overlaid")) : null);
}

// -- curves -------------------------------------------------------------------------------------------------------
const CHARTS = [
  ["reward", ["rollout/reward"]], ["accuracy", ["rollout/accuracy"]], ["held-out", ["eval/accuracy"]],
  ["response length", ["rollout/response_len"]], ["entropy", ["rl/entropy"]], ["KL to behaviour", ["rl/kl_behavior"]],
  ["staleness share", ["stale/masked_frac", "async/stale_token_frac"]],
  ["time split (cumulative s)", ["time/rollout_s", "time/train_s", "time/reward_wait_s"]],
  ["in flight", ["dispatch/inflight", "rollout/concurrency_mean"]],
  ["tokens/s", ["rollout/tokens_per_s", "train/tokens_per_s"]],
];
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

function withBreakdown(metrics, keys) {
  // a chart's metrics that the runs log, each followed by its breakdowns: rollout/reward/<dataset>, .../effort<b>,
  // .../teacher_<name> (rl/metrics.py rollout_breakdown) and eval/<dataset>/accuracy for the held-out accuracy
  const out = [];
  const all = [...keys].sort();
  for (const m of metrics) {
    if (keys.has(m)) out.push(m);
    if (m.startsWith("rollout/")) out.push(...all.filter((k) => k.startsWith(`${m}/`)));
    if (m.startsWith("eval/")) {
      const leaf = m.slice("eval/".length);
      out.push(...all.filter((k) => k.startsWith("eval/") && k.endsWith(`/${leaf}`) && k.split("/").length === 3));
    }
  }
  return out;
}

function mergeSeries(curves) {
  // uPlot wants one x array: the union of steps, each series null where it has no point
  const xs = Array.from(new Set(curves.flatMap((c) => c.x))).sort((a, b) => a - b);
  const at = new Map(xs.map((x, i) => [x, i]));
  const ys = curves.map((c) => {
    const y = new Array(xs.length).fill(null);
    c.x.forEach((x, i) => { y[at.get(x)] = c.y[i]; });
    return y;
  });
  return [xs, ...ys];
}

function versionMarks(steps) {
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        ctx.save();
        ctx.strokeStyle = "#999";
        ctx.setLineDash([4, 4]);
        for (const s of steps) {
          const x = u.valToPos(s, "x", true);
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
        }
        ctx.restore();
      }],
    },
  };
}

async function drawCharts(container, runKeys, names, extra) {
  const keys = new Set();
  const versions = [];
  for (const k of runKeys) {
    (await api("keys", { run: k })).keys.forEach((x) => keys.add(x));
    (await api("run", { run: k })).config_versions.forEach((v) => { if (v.status === "applied") versions.push(v.train_step); });
  }
  const charts = CHARTS.map(([title, metrics]) => [title, withBreakdown(metrics, keys)]);
  for (const m of extra) if (keys.has(m)) charts.push([m, [m]]);
  const nodes = [];
  for (const [title, metrics] of charts) {
    if (!metrics.length) continue;
    const curves = [];
    const series = [{ label: "step" }];
    for (const k of runKeys) {
      for (const m of metrics) {
        curves.push(await api("curve", { run: k, metric: m }));
        series.push({ label: `${names[k]} ${m}`, stroke: COLORS[(series.length - 1) % COLORS.length], spanGaps: true });
      }
    }
    const box = el("div", { class: "chart", "data-chart": title, "data-points": curves.reduce((n, c) => n + c.x.length, 0),
      "data-series": metrics.join(" ") },
      el("h3", {}, title));
    nodes.push(box);
    const data = mergeSeries(curves);
    const opts = { width: 440, height: 220, series, scales: { x: { time: false } }, plugins: [versionMarks(versions)] };
    new uPlot(opts, data, box); // eslint-disable-line no-undef
  }
  container.replaceChildren(...nodes);
  if (!nodes.length) container.appendChild(el("p", {}, "no metrics yet"));
}

async function curvesPage(params) {
  const { runs } = await api("runs");
  const names = Object.fromEntries(runs.map((r) => [r.key, r.name]));
  const chosen = (params.get("runs") || runs.map((r) => r.key).join(",")).split(",").filter((k) => k in names);
  const extra = (params.get("extra") || "").split(",").filter(Boolean);
  const keys = chosen.length ? (await api("keys", { run: chosen[0] })).keys : [];
  const picker = el("select", { id: "add-metric" }, el("option", { value: "" }, "add a metric..."),
    keys.map((k) => el("option", { value: k }, k)));
  picker.addEventListener("change", () => {
    if (!picker.value) return;
    const q = new URLSearchParams({ runs: chosen.join(","), extra: [...extra, picker.value].join(",") });
    location.hash = `#/curves?${q}`;
  });
  const container = el("div", { class: "charts", id: "charts" });
  show(el("h2", {}, "Curves: ", chosen.map((k) => names[k]).join(", ")),
    el("p", { class: "legend" }, "Dashed lines: live reconfigurations (applied config versions). Live: redrawn every 5 s."),
    picker, container);
  await drawCharts(container, chosen, names, extra);
  timer = setInterval(() => drawCharts(container, chosen, names, extra).catch(fail), 5000);
}

// -- samples ------------------------------------------------------------------------------------------------------
const FILTERS = ["dataset", "step", "min_reward", "max_reward", "finish_reason", "failure", "effort", "teacher", "min_lag"];

async function samplesPage(params) {
  const { runs } = await api("runs");
  const run = params.get("run") || (runs[0] && runs[0].key);
  if (run === undefined) return show(el("p", {}, "no runs"));
  const form = el("form", { class: "filters", id: "filters" },
    el("label", {}, "run", el("select", { name: "run" }, runs.map((r) => el("option", r.key === run ? { value: r.key, selected: "" } : { value: r.key }, r.name)))),
    FILTERS.map((f) => el("label", {}, f, el("input", { name: f, value: params.get(f) || "" }))),
    el("label", {}, "sort", el("select", { name: "sort" }, ["seq", "-seq", "reward", "-reward", "step", "-step", "length", "-length", "lag", "-lag"]
      .map((s) => el("option", s === (params.get("sort") || "seq") ? { value: s, selected: "" } : { value: s }, s)))),
    el("button", { type: "submit", id: "apply" }, "apply"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(form).entries()) if (v !== "") q.set(k, v);
    location.hash = `#/samples?${q}`;
  });
  const offset = Number(params.get("offset") || 0);
  const query = Object.fromEntries([...params.entries()].filter(([k]) => k !== "run"));
  const page = await api("samples", { ...query, run, offset, limit: 50 });
  const rows = page.rows.map((s) => el("tr", { "data-sample": s.sample_id },
    el("td", {}, el("a", { href: `#/sample?run=${run}&id=${encodeURIComponent(s.sample_id)}` }, s.sample_id)),
    el("td", {}, s.dataset), el("td", { class: "num" }, fmt(s.step)), el("td", { class: "num" }, fmt(s.reward, 3)),
    el("td", {}, s.finish_reason), el("td", {}, s.failure || ""), el("td", { class: "num" }, fmt(s.effort)),
    el("td", {}, s.teacher || ""), el("td", { class: "num" }, fmt(s.tokens)), el("td", { class: "num" }, fmt(s.lag)),
    el("td", {}, s.preview)));
  const nav = (o) => { const q = new URLSearchParams(params); q.set("offset", Math.max(0, o)); return `#/samples?${q}`; };
  show(el("h2", {}, "Samples"), form,
    el("table", { id: "samples" },
      el("thead", {}, el("tr", {}, ["sample", "dataset", "step", "reward", "finish", "failure", "effort", "teacher", "tokens", "lag", "response"].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows)),
    el("p", {}, offset > 0 ? el("a", { href: nav(offset - 50), id: "prev" }, "previous") : null, " ",
      `rows ${offset + 1}-${offset + page.rows.length}`, " ",
      page.rows.length === 50 ? el("a", { href: nav(offset + 50), id: "next" }, "next") : null));
}

// -- one sample ---------------------------------------------------------------------------------------------------
function tokenColor(t, mode, vmin, vmax) {
  if (mode === "logprob") {
    const p = Math.exp(Math.max(t.logprob, -20)); // 1: certain (white) .. 0: unlikely (red)
    return `rgb(255, ${Math.round(120 + 135 * p)}, ${Math.round(120 + 135 * p)})`;
  }
  if (mode === "stale") {
    if (t.stale === null || t.stale === undefined) return "#ffffff";
    return t.stale ? "#ffb3b3" : t.trained ? "#d8f5d0" : "#e6e6e6";
  }
  if (mode === "version") {
    const f = vmax > vmin ? (t.version - vmin) / (vmax - vmin) : 0;
    return `hsl(${Math.round(220 - 180 * f)}, 70%, 85%)`;
  }
  return t.trained ? "#d8f5d0" : "#e6e6e6";
}

function renderTokens(box, tokens, mode) {
  const versions = tokens.filter((t) => t.trained).map((t) => t.version);
  const vmin = Math.min(...versions), vmax = Math.max(...versions);
  box.replaceChildren(...tokens.map((t, i) => el("span", {
    class: t.trained ? "tok" : "tok masked", "data-i": i, "data-version": t.version,
    "data-stale": t.stale === null ? "unknown" : String(t.stale),
    title: `#${t.id} logprob ${fmt(t.logprob)} version ${t.version}${t.trained ? "" : " (not trained: tool output)"}${t.stale ? " (stale: masked)" : ""}`,
  }, t.text)));
  box.querySelectorAll("span.tok").forEach((s, i) => { s.style.background = tokenColor(tokens[i], mode, vmin, vmax); });
}

async function samplePage(params) {
  const s = await api("sample", { run: params.get("run"), id: params.get("id") });
  const fields = [["sample", s.sample_id], ["dataset", s.dataset], ["status", s.status], ["finish reason", s.finish_reason],
    ["failure", s.failure], ["reward", fmt(s.reward, 3)], ["correct", s.correct ? "yes" : "no"], ["verdict", s.reason],
    ["train step", fmt(s.train_step)], ["config version", fmt(s.config_version)], ["effort", fmt(s.effort)],
    ["teacher", s.teacher], ["segments", s.segments.map(([a, b, v]) => `[${a},${b}) v${v}`).join("  ")]];
  const box = el("div", { class: "tokens", id: "tokens" });
  const mode = el("select", { id: "color-mode" }, ["logprob", "version", "trained", "stale"].map((m) => el("option", { value: m }, m)));
  mode.addEventListener("change", () => renderTokens(box, s.tokens, mode.value));
  show(el("h2", {}, "Sample"),
    el("table", { class: "fields", id: "fields" }, fields.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", { "data-field": k }, v ?? "-")))),
    el("h3", {}, "Prompt"), el("pre", { id: "prompt" }, s.prompt),
    el("h3", {}, "Response, token by token"),
    el("p", { class: "legend" }, "colour by ", mode,
      " (logprob: white certain, red unlikely; version: blue oldest, red newest; stale: red masked as stale, green kept; dashed: not trained)"),
    el("p", { class: "legend", id: "stale-note" }, `staleness: ${s.stale_note}`),
    box,
    s.turns.length ? el("h3", {}, "Turns") : null,
    s.turns.map((t) => el("div", { class: "turn", "data-turn": t.kind },
      el("span", { class: "kind" }, t.kind === "tool" ? `tool ${t.tool || ""} (${t.status || "-"}, exit ${fmt(t.exit_code)})` : "model"),
      t.call ? el("pre", {}, t.call) : null, el("pre", {}, t.text))));
  renderTokens(box, s.tokens, "logprob");
}

// -- dispatch timeline -------------------------------------------------------------------------------------------
async function timelinePage(params) {
  const { runs } = await api("runs");
  const run = params.get("run") || (runs[0] && runs[0].key);
  if (run === undefined) return show(el("p", {}, "no runs"));
  const t = await api("timeline", { run });
  const applied = t.config_versions.filter((v) => v.status === "applied").map((v) => v.train_step);
  const box = el("div", { class: "chart", id: "timeline-chart", "data-points": t.steps.length }, el("h3", {}, "train step over wall time (minutes)"));
  const picker = el("select", { id: "timeline-run" }, runs.map((r) => el("option", r.key === run ? { value: r.key, selected: "" } : { value: r.key }, r.name)));
  picker.addEventListener("change", () => { location.hash = `#/timeline?run=${picker.value}`; });
  show(el("h2", {}, "Dispatch timeline"), picker, box,
    el("h3", {}, "Config versions (live reconfigurations)"),
    el("table", { id: "versions" },
      el("thead", {}, el("tr", {}, ["version", "status", "train step", "patch", "reason"].map((h) => el("th", {}, h)))),
      el("tbody", {}, t.config_versions.map((v) => el("tr", { "data-status": v.status },
        el("td", { class: "num" }, fmt(v.version)), el("td", {}, v.status), el("td", { class: "num" }, fmt(v.train_step)),
        el("td", {}, JSON.stringify(v.patch)), el("td", {}, v.reason || ""))))),
    el("h3", {}, "Restarts"),
    t.restarts.length ? el("table", { id: "restarts" },
      el("thead", {}, el("tr", {}, ["checkpoint", "train step", "prompts redispatched", "samples regenerated", "steps rolled back"].map((h) => el("th", {}, h)))),
      el("tbody", {}, t.restarts.map((r) => el("tr", {}, el("td", {}, r.checkpoint), el("td", { class: "num" }, fmt(r.train_step)),
        el("td", { class: "num" }, fmt(r.prompts_redispatched)), el("td", { class: "num" }, fmt(r.samples_regenerated)),
        el("td", { class: "num" }, fmt(r.train_steps_rolled_back))))))
      : el("p", {}, "none"));
  const marks = { hooks: { draw: [(u) => {
    const ctx = u.ctx; ctx.save(); ctx.strokeStyle = "#999"; ctx.setLineDash([4, 4]);
    for (const s of applied) {
      const y = u.valToPos(s, "y", true);
      ctx.beginPath(); ctx.moveTo(u.bbox.left, y); ctx.lineTo(u.bbox.left + u.bbox.width, y); ctx.stroke();
    }
    ctx.restore();
  }] } };
  new uPlot({ width: 900, height: 300, series: [{ label: "minutes" }, { label: "train step", stroke: COLORS[0] }],  // eslint-disable-line no-undef
    scales: { x: { time: false } }, plugins: [marks] }, [t.minutes, t.steps], box);
}

// -- router -------------------------------------------------------------------------------------------------------
async function render() {
  if (timer) { clearInterval(timer); timer = null; }
  const { path, params } = route();
  status.textContent = "";
  main.removeAttribute("data-ready");
  try {
    if (path === "/" || path === "") await runsPage();
    else if (path === "/curves") await curvesPage(params);
    else if (path === "/samples") await samplesPage(params);
    else if (path === "/sample") await samplePage(params);
    else if (path === "/timeline") await timelinePage(params);
    else show(el("p", {}, `no page ${path}`));
    main.setAttribute("data-ready", path);
  } catch (e) {
    fail(e);
  }
}

window.addEventListener("hashchange", render);
render();
