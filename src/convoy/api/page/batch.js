// Side by side: N prompts (or one prompt with n) in ONE streamed /v1/completions request, each
// choice streaming into its own panel by its global `index` (prompt_index * n + j).

import { call, events, isAbort, server, showError } from "./api.js";
import { mountSampling, readSampling } from "./sampling.js";

export const DEFAULT_PROMPTS = [
  "Write a haiku about a lighthouse in winter:\n",
  "The three most important inventions of the twentieth century are",
  "def is_prime(n):\n    ",
  "Dear hiring manager, I am writing to apply for",
  "A recipe for fluffy pancakes.\nIngredients:\n-",
  "Q: Why is the sky blue?\nA:",
  "Once upon a time, a small robot who loved gardening",
  "Translate to French: The train leaves at noon.\nFrench:",
];
const MAX_PANELS = 32;

const $ = (id) => document.getElementById(id);
let controller = null; // the request in flight: Stop aborts it (the server frees its sequences)

export function initBatch() {
  mountSampling($("batch-sampling"), "batch", { max_tokens: 64, temperature: 0.8, top_p: 0.95 });
  setPanels(DEFAULT_PROMPTS.length);
  $("batch-count").addEventListener("change", () => setPanels(Number($("batch-count").value)));
  $("batch-same").addEventListener("change", updateSame);
  $("batch-form").addEventListener("submit", (event) => {
    event.preventDefault();
    generate();
  });
  $("batch-stop").addEventListener("click", () => controller?.abort());
}

// Add or remove panels to have `count`, keeping what was typed in the ones kept.
function setPanels(count) {
  count = Math.min(MAX_PANELS, Math.max(1, Math.floor(count) || 1));
  $("batch-count").value = count;
  const grid = $("batch-panels");
  while (grid.children.length > count) grid.lastElementChild.remove();
  while (grid.children.length < count) {
    const i = grid.children.length;
    grid.append(makePanel(i, DEFAULT_PROMPTS[i % DEFAULT_PROMPTS.length]));
  }
  updateSame();
  $("batch-generate").textContent = `Generate ${count} at once`;
}

function makePanel(i, prompt) {
  const panel = document.createElement("article");
  panel.className = "panel";
  panel.dataset.index = i;
  const label = document.createElement("label");
  label.htmlFor = `batch-prompt-${i}`;
  label.className = "panel-title";
  label.textContent = `index ${i}`;
  const input = document.createElement("textarea");
  input.id = `batch-prompt-${i}`;
  input.className = "prompt";
  input.rows = 2;
  input.value = prompt;
  const out = document.createElement("pre");
  out.className = "out";
  out.setAttribute("aria-label", `output ${i}`);
  const foot = document.createElement("p");
  foot.className = "panel-foot";
  panel.append(label, input, out, foot);
  return panel;
}

// "One prompt, n choices": the first panel's prompt is sent once with n = panels.
function updateSame() {
  const same = $("batch-same").checked;
  for (const panel of $("batch-panels").children) {
    const input = panel.querySelector(".prompt");
    const isFirst = panel.dataset.index === "0";
    input.hidden = same && !isFirst;
    panel.querySelector(".panel-title").textContent =
      same && !isFirst ? `index ${panel.dataset.index} (same prompt)` : `index ${panel.dataset.index}`;
  }
}

function requestBody() {
  const panels = [...$("batch-panels").children];
  const prompts = panels.map((p) => p.querySelector(".prompt").value);
  const body = {
    model: server.model,
    prompt: prompts,
    stream: true,
    stream_options: { include_usage: true },
    logprobs: 0, // each chunk lists its tokens: the panels count them
    ...readSampling("batch"),
  };
  if ($("batch-same").checked) {
    body.prompt = prompts[0];
    body.n = panels.length;
  }
  return body;
}

async function generate() {
  const panels = [...$("batch-panels").children];
  const body = requestBody();
  for (const panel of panels) {
    panel.querySelector(".out").textContent = "";
    panel.querySelector(".panel-foot").textContent = "";
    panel.dataset.tokens = "0";
    panel.dataset.finish = "";
    panel.classList.add("streaming");
  }
  showError($("batch-error"), null);
  setRunning(true);
  const run = new Run(panels);
  controller = new AbortController();
  try {
    const response = await call("/v1/completions", { method: "POST", json: body, signal: controller.signal });
    for await (const chunk of events(response)) {
      if (chunk.usage && chunk.choices.length === 0) run.usage = chunk.usage;
      for (const choice of chunk.choices) run.add(choice);
    }
    run.paint("done");
  } catch (err) {
    run.paint(isAbort(err) ? "stopped" : "failed");
    if (!isAbort(err)) showError($("batch-error"), err);
  } finally {
    for (const panel of panels) panel.classList.remove("streaming");
    setRunning(false);
    controller = null;
  }
}

// One generation: what arrived is kept and painted once a frame (hundreds of chunks a second
// would otherwise lay the page out hundreds of times, taking CPU from a server on this machine).
class Run {
  constructor(panels) {
    this.panels = panels;
    this.pending = new Map(); // panel index -> text not yet shown
    this.tokens = panels.map(() => 0);
    this.finish = panels.map(() => "");
    this.started = performance.now();
    this.firstToken = null;
    this.usage = null;
    this.frame = 0;
  }

  add(choice) {
    const i = choice.index;
    if (!(i in this.panels)) return;
    this.firstToken ??= performance.now();
    this.pending.set(i, (this.pending.get(i) ?? "") + choice.text);
    this.tokens[i] += choice.logprobs?.tokens?.length ?? 0; // the tokens of this delta
    if (choice.finish_reason) this.finish[i] = choice.finish_reason;
    this.frame ||= requestAnimationFrame(() => this.paint("streaming"));
  }

  paint(state) {
    cancelAnimationFrame(this.frame);
    this.frame = 0;
    for (const [i, text] of this.pending) {
      const panel = this.panels[i];
      const out = panel.querySelector(".out");
      const isAtEnd = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
      out.append(text);
      if (isAtEnd) out.scrollTop = out.scrollHeight; // follow the stream unless scrolled back
      panel.dataset.tokens = this.tokens[i];
      panel.dataset.finish = this.finish[i];
      if (this.finish[i]) panel.classList.remove("streaming");
      const finish = this.finish[i] ? ` · finish: ${this.finish[i]}` : "";
      panel.querySelector(".panel-foot").textContent = `${this.tokens[i]} tokens${finish}`;
    }
    this.pending.clear();
    this.summarize(state);
  }

  summarize(state) {
    const seconds = (performance.now() - this.started) / 1000;
    const tokens = this.tokens.reduce((a, b) => a + b, 0);
    const parts = [
      `${this.panels.length} choices from 1 request`,
      `${tokens} tokens in ${seconds.toFixed(1)} s (${(tokens / Math.max(seconds, 1e-3)).toFixed(0)} tokens/s)`,
    ];
    if (this.firstToken !== null) {
      parts.push(`first token after ${((this.firstToken - this.started) / 1000).toFixed(2)} s`);
    }
    const usage = this.usage;
    if (usage) parts.push(`usage: ${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    parts.push(state);
    $("batch-summary").textContent = parts.join(" · ");
    $("batch-summary").dataset.state = state;
  }
}

function setRunning(isRunning) {
  $("batch-generate").disabled = isRunning;
  $("batch-stop").disabled = !isRunning;
}

export function startBatch() {
  if (!controller) $("batch-form").requestSubmit();
}
