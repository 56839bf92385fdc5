// Live numbers: /metrics (Prometheus text) read every second; tokens/s from the generated-tokens
// counter's deltas, a sparkline of it over the last minute.

import { call, ServerError } from "./api.js";

const PERIOD_MS = 1000;
const HISTORY = 60; // samples in the sparkline: one a second, the last minute
const $ = (id) => document.getElementById(id);

const rates = [];
let last = null; // {tokens, time} of the previous reading
// NOTE: behind `--replicas` each reading comes from one replica (x-convoy-replica): the
// generated tokens are the sum of each replica's latest count; the gauges are that replica's.
const counts = new Map();
let timer = null;

// The samples of a Prometheus text exposition, summed by metric name (labels dropped: a
// server behind Ray Serve labels each replica's samples; their sum is the server's figure).
export function parseMetrics(text) {
  const totals = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)/.exec(line);
    if (!match) continue;
    totals.set(match[1], (totals.get(match[1]) ?? 0) + Number(match[3]));
  }
  return totals;
}

export function startNumbers() {
  if (timer === null) tick();
}

async function tick() {
  try {
    await refresh();
  } finally {
    timer = setTimeout(tick, PERIOD_MS);
  }
}

// Read /metrics once and show it (also called at once when the key changes).
export async function refresh() {
  let metrics;
  let replica;
  try {
    const response = await call("/metrics");
    replica = response.headers.get("x-convoy-replica");
    metrics = parseMetrics(await response.text());
  } catch (err) {
    last = null;
    $("numbers-status").textContent =
      err instanceof ServerError && err.status === 401 ? "needs the API key" : `no reading: ${err.message}`;
    return;
  }
  $("numbers-status").textContent = replica === null ? "" : `from replica ${replica}`;
  const now = performance.now();
  counts.set(replica, metrics.get("convoy_generation_tokens_total") ?? 0);
  const tokens = [...counts.values()].reduce((a, b) => a + b, 0);
  if (last !== null && now - last.time < PERIOD_MS / 2) return; // two readings at once
  if (last !== null) {
    const rate = Math.max(0, tokens - last.tokens) / ((now - last.time) / 1000);
    rates.push(rate);
    if (rates.length > HISTORY) rates.shift();
    show("m-tps", rate, rate.toFixed(1));
    $("m-peak").textContent = `peak ${Math.max(...rates).toFixed(0)} over the last minute`;
    drawSparkline();
  }
  last = { tokens, time: now };
  show("m-running", metrics.get("convoy_num_requests_running"));
  show("m-waiting", metrics.get("convoy_num_requests_waiting"));
  const used = metrics.get("convoy_kv_blocks_used");
  const total = metrics.get("convoy_kv_blocks_total");
  show("m-kv", used, used === undefined ? undefined : `${used} / ${total}`);
  show("m-queue", metrics.get("convoy_batch_queue_lines"));
}

function show(id, value, text) {
  const el = $(id);
  el.dataset.value = value ?? "";
  el.textContent = value === undefined ? "—" : (text ?? String(value));
}

function drawSparkline() {
  const svg = $("m-spark");
  const width = 200;
  const height = 40;
  const top = Math.max(1, ...rates);
  const step = width / (HISTORY - 1);
  const offset = HISTORY - rates.length; // the newest sample at the right edge
  const points = rates.map((r, i) => `${((offset + i) * step).toFixed(1)},${(height - (r / top) * (height - 2) - 1).toFixed(1)}`);
  svg.querySelector("polyline").setAttribute("points", points.join(" "));
  svg.setAttribute("aria-label", `tokens per second over the last minute, peak ${top.toFixed(0)}`);
}
