// JustFit's status page: polls /v1/justfit/live every 500 ms, keeps the memory history
// it is sent, and renders it with uPlot. No framework, no build step.
"use strict";

const POLL_MS = 500;
const KEEP = 1200; // samples in the chart: ten minutes at two a second
const KEY = "justfit-api-key";
const COLORS = { weights_resident: "#4c78a8", weights_materialized: "#9ecae9", transient: "#f58518",
                 states_memory: "#54a24b", mlx_cache: "#c7c7c7" };
const KV_COLORS = ["#b279a2", "#e45756", "#eeca3b", "#72b7b2", "#ff9da6", "#9d755d", "#bab0ac"];
const LABELS = { weights_resident: "weights resident", weights_materialized: "weights materialized",
                 transient: "transient", states_memory: "stored states (memory)", mlx_cache: "MLX cache (freed, kept)" };
// Lines over the stacked bands, on the same MiB scale: the whole process, and the budgets.
const LINES = { rss: { label: "process (RSS)", stroke: "#1d2330", width: 2 },
                budget: { label: "budget (MLX's memory)", stroke: "#d33", width: 2, dash: [6, 4] },
                process_budget: { label: "whole-process budget (RSS)", stroke: "#7a0019", width: 2, dash: [2, 3] } };

let history = [], lastT = 0, chart = null, chartKinds = "", kvColors = {};
window.justfitLast = null; // the last document rendered (for tests and the curious)
window.justfitChart = null; // the uPlot chart (its series and scales, for tests)

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));

function size(n) {
  if (n == null) return "none";
  for (const [u, s] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) if (Math.abs(n) >= s) return (n / s).toFixed(1) + " " + u;
  return n + " B";
}
const num = (n) => (n == null ? "" : Number(n).toLocaleString("en-US"));
const secs = (s) => (s == null ? "" : s < 1 ? Math.round(s * 1000) + " ms" : s.toFixed(2) + " s");

function cell(value, text, field) {
  const attrs = field ? ` data-field="${field}"` : "";
  return `<td data-value="${esc(value ?? "")}"${attrs}>${esc(text ?? value ?? "")}</td>`;
}

function setField(field, value, text) {
  for (const el of document.querySelectorAll(`[data-field="${field}"]`)) {
    el.dataset.value = value ?? "";
    el.textContent = text ?? value ?? "";
  }
}

// -- memory: what MLX holds by kind, stacked bottom to top; the process and budgets as lines
function kinds(sample) {
  const kv = Object.keys(sample.kv || {}).sort().map((f) => "kv:" + f);
  return ["weights_resident", "weights_materialized", ...kv, "transient", "states_memory", "mlx_cache"];
}

const mlxTotal = (sample) => kinds(sample).reduce((sum, k) => sum + value(sample, k), 0);
const lineLabel = (key, sample) => key === "budget" && sample.process_budget != null
  ? "engine's share of the budget (MLX's memory)" : LINES[key].label;

function value(sample, kind) {
  return kind.startsWith("kv:") ? (sample.kv || {})[kind.slice(3)] || 0 : sample[kind] || 0;
}

function color(kind) {
  if (COLORS[kind]) return COLORS[kind];
  if (!kvColors[kind]) kvColors[kind] = KV_COLORS[Object.keys(kvColors).length % KV_COLORS.length];
  return kvColors[kind];
}

const label = (kind) => LABELS[kind] || "KV " + kind.slice(3);

function chartData(order) {
  const xs = history.map((s) => s.t);
  const stacked = [], running = history.map(() => 0);
  for (const kind of order) {
    history.forEach((s, i) => { running[i] += value(s, kind) / 2 ** 20; });
    stacked.push(running.slice());
  }
  const lines = Object.keys(LINES).map((key) => history.map((s) => (s[key] == null ? null : s[key] / 2 ** 20)));
  // Drawn top of the stack first, so each lower band paints over the one above it.
  return [xs, ...stacked.reverse(), ...lines];
}

function drawChart() {
  const all = new Set();
  history.forEach((s) => kinds(s).forEach((k) => all.add(k)));
  const order = kinds({ kv: Object.fromEntries([...all].filter((k) => k.startsWith("kv:")).map((k) => [k.slice(3), 0])) });
  const el = $("memchart"), last = history[history.length - 1];
  const key = order.join() + "|" + lineLabel("budget", last);
  if (key !== chartKinds) {
    if (chart) chart.destroy();
    chartKinds = key;
    const series = [{}, ...order.slice().reverse().map((k) => ({ label: label(k), stroke: color(k), fill: color(k) + "cc",
                                                               width: 1, points: { show: false } })),
                    ...Object.entries(LINES).map(([k, l]) => ({ ...l, label: lineLabel(k, last), points: { show: false } }))];
    chart = new uPlot({ width: el.clientWidth || 900, height: 260, series, legend: { show: false },
                        scales: { y: { range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.05] } },
                        axes: [{}, { label: "MiB", size: 60 }] }, chartData(order), el);
    window.justfitChart = chart;
  } else {
    chart.setData(chartData(order));
  }
}

// The chart in words (its aria-label and the line under it): what MLX holds, what the
// process holds, and the budgets each is held to.
function describeMemory(now) {
  const mlx = mlxTotal(now), parts = [`MLX holds ${size(mlx)} (the stacked bands)`];
  if (now.rss != null) {
    parts.push(`the process ${size(now.rss)} (RSS, the solid line), ${size(Math.max(0, now.rss - mlx))} of it outside MLX`);
  }
  if (now.budget != null) parts.push(`${lineLabel("budget", now)} ${size(now.budget)} (the dashed red line)`);
  if (now.process_budget != null) {
    parts.push(`whole-process budget ${size(now.process_budget)} (the dotted line, over the RSS)`);
  }
  return "Now: " + parts.join("; ") + ".";
}

function renderKinds(now) {
  const order = kinds(now), mlx = mlxTotal(now);
  const band = (k) => `<tr><td><span class="swatch" style="background:${color(k)}"></span>${esc(label(k))}</td>` +
    cell(value(now, k), size(value(now, k)), "mem:" + k) + "</tr>";
  const line = (k, text, v) => `<tr class="line"><td><span class="swatch line" style="border-color:${LINES[k].stroke};` +
    `border-top-style:${LINES[k].dash ? "dashed" : "solid"}"></span>${esc(text)}</td>` + cell(v, size(v), "mem:" + k) + "</tr>";
  const total = `<tr class="total"><td>MLX in all</td>${cell(mlx, size(mlx), "mem:mlx_total")}</tr>`;
  let rows = order.map(band).join("") + total;
  if (now.rss != null) {
    rows += line("rss", LINES.rss.label, now.rss);
    const outside = Math.max(0, now.rss - mlx);
    rows += '<tr><td class="sub">of it outside MLX (interpreter, libraries, tokenizer, server)</td>' +
      cell(outside, size(outside), "mem:outside") + "</tr>";
  }
  if (now.budget != null) rows += line("budget", lineLabel("budget", now), now.budget);
  if (now.process_budget != null) rows += line("process_budget", LINES.process_budget.label, now.process_budget);
  $("kinds").innerHTML = rows;
  const words = describeMemory(now);
  $("memdesc").textContent = words;
  $("memchart").setAttribute("aria-label", "Memory over the last minutes. " + words);
}

// -- capacity: the format in use, then the pressure ladder's next steps, the trained context marked
function renderCapacity(doc) {
  $("capacity-kind").textContent = `under the ${doc.capacity_budget_kind}, ${size(doc.capacity_budget)}: ` +
    "the KV format in use, then every page stepped down the pressure ladder";
  const trained = '<tr class="trained"><td>trained context</td>' +
    cell(doc.context_limit, num(doc.context_limit), "capacity:trained") +
    '<td></td><td class="note">the most one request holds</td></tr>';
  let rows = "", marked = false;
  for (const c of doc.capacity) {
    if (!marked && c.max_positions > doc.context_limit) { rows += trained; marked = true; }
    const note = (c.in_use ? "in use" : `step ${c.step} of the ladder`) +
      (c.past_context ? "; past the trained context: needs a model that extrapolates" : "");
    rows += `<tr class="${c.in_use ? "in-use" : ""}${c.past_context ? " past-context" : ""}"><td>${esc(c.label)}</td>` +
      cell(c.max_positions, num(c.max_positions) + (c.past_context ? " †" : ""), "capacity:" + c.format) +
      cell(c.left, num(c.left), "left:" + c.format) + `<td class="note" data-field="past:${esc(c.format)}" ` +
      `data-value="${c.past_context}">${esc(note)}</td></tr>`;
  }
  $("capacity").innerHTML = rows + (marked ? "" : trained);
}

// -- tables ------------------------------------------------------------------------------
function renderRunning(doc) {
  // With batching every computing request has a row (oldest first); without, the one running.
  const rows = doc.batch && doc.batch.length ? doc.batch : doc.running ? [doc.running] : [], el = $("running");
  if (!rows.length) { el.className = "empty"; el.innerHTML = '<span data-field="running">idle</span>'; return; }
  el.className = "";
  el.innerHTML = rows.map((r) => {
    const pct = r.phase === "prefill" ? (100 * r.processed) / Math.max(1, r.prompt_tokens)
                                      : (100 * r.generated) / Math.max(1, r.max_tokens);
    return `<div data-field="running" data-value="${r.phase}">${esc(r.route)} · <b>${r.phase}</b> · ` +
      `<span data-field="processed" data-value="${r.processed}">${num(r.processed)}</span> of ` +
      `<span data-field="prompt_tokens" data-value="${r.prompt_tokens}">${num(r.prompt_tokens)}</span> prompt tokens, ` +
      `<span data-field="generated" data-value="${r.generated}">${num(r.generated)}</span> generated · ${secs(r.elapsed_s)}</div>` +
      `<div class="bar"><div style="width:${pct.toFixed(1)}%"></div></div>`;
  }).join("");
}

function render(doc) {
  window.justfitLast = doc;
  setField("model", doc.model); setField("policy", doc.policy); setField("kv_format", doc.kv_format);
  setField("blas", doc.blas); setField("backend", doc.backend);
  setField("budget", doc.budget, doc.budget == null ? "none" : doc.process_budget == null ? size(doc.budget)
    : `${size(doc.process_budget)} for the whole process, ${size(doc.budget)} of it the engine's`);
  setField("context_limit", doc.context_limit, num(doc.context_limit));
  setField("completed", doc.requests.completed, `${num(doc.requests.completed)} done`);
  setField("queued", doc.queued.length); setField("states", doc.states.length);
  renderRunning(doc);
  $("queued").innerHTML = doc.queued.map((q) => `<tr>${cell(q.route)}${cell(q.prompt_tokens, num(q.prompt_tokens))}` +
    `${cell(q.max_tokens, num(q.max_tokens))}${cell(q.waited_s, secs(q.waited_s))}</tr>`).join("");
  renderCapacity(doc);
  $("recent").innerHTML = doc.recent.map((r) => "<tr>" + cell(r.prompt_tokens, num(r.prompt_tokens)) +
    cell(r.cached_tokens, num(r.cached_tokens)) + cell(r.restored_from || "-") + cell(r.generated_tokens, num(r.generated_tokens)) +
    cell(r.queue_s, secs(r.queue_s)) + cell(r.prefill_s, secs(r.prefill_s)) + cell(r.decode_s, secs(r.decode_s)) +
    cell(r.prefill_tps, num(r.prefill_tps)) + cell(r.decode_tps, num(r.decode_tps)) +
    cell(r.accepted_tokens, r.drafted_tokens ? `${num(r.accepted_tokens)}/${num(r.drafted_tokens)} ` +
      `(${Math.round(100 * r.acceptance_rate)}%)` : "-") +
    cell(r.kv_disk_bytes, r.kv_disk_bytes ? size(r.kv_disk_bytes) : "-") +
    cell(r.kv_disk_read_mb_s, r.kv_disk_read_mb_s == null ? "-" : num(r.kv_disk_read_mb_s)) +
    cell(r.finish_reason) + "</tr>").join("");
  $("states").innerHTML = doc.states.map((s) => "<tr>" + cell(s.name ?? "", s.name ?? "(prefix cache)") + cell(s.where) +
    cell(s.tokens, num(s.tokens)) + cell(s.memory_bytes, size(s.memory_bytes)) + cell(s.disk_bytes, size(s.disk_bytes)) +
    cell(s.age_s, secs(s.age_s)) + "</tr>").join("");
  renderKinds(doc.now);
  if (history.length) drawChart();
}

// -- polling -----------------------------------------------------------------------------
function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function poll() {
  try {
    const resp = await fetch(`/v1/justfit/live?since=${lastT}`, { headers: headers(), cache: "no-store" });
    if (resp.status === 401) {
      $("keyform").hidden = false;
      $("conn").className = "conn err"; $("conn").textContent = "API key needed";
      return; // polling resumes when a key is entered
    }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const doc = await resp.json();
    history.push(...doc.history);
    if (history.length > KEEP) history = history.slice(-KEEP);
    if (history.length) lastT = history[history.length - 1].t;
    render(doc);
    $("conn").className = "conn ok"; $("conn").textContent = "live";
  } catch (err) {
    $("conn").className = "conn err"; $("conn").textContent = "disconnected (" + err.message + ")";
  }
  setTimeout(poll, POLL_MS);
}

$("keyform").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("keyform").hidden = true;
  poll();
});
window.addEventListener("resize", () => chart && chart.setSize({ width: $("memchart").clientWidth, height: 260 }));
poll();
