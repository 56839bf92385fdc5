// Batch jobs: upload a JSONL file (the Batch API's format), start a batch, watch its
// request_counts, cancel it, download its output and error files.

import { call, callJson, server, showError } from "./api.js";

const POLL_MS = 1000;
const FINAL = new Set(["completed", "failed", "expired", "cancelled"]);
const $ = (id) => document.getElementById(id);

let watched = null; // the batch shown
let timer = null;

export function initJobs() {
  $("jobs-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const file = $("jobs-file").files[0];
    if (file) run(file);
    else showError($("jobs-error"), new Error("choose a .jsonl file first"));
  });
  $("jobs-sample").addEventListener("click", () => run(sampleFile()));
  $("job-cancel").addEventListener("click", cancel);
  $("job-output").addEventListener("click", () => download(watched?.output_file_id, "output"));
  $("job-errors").addEventListener("click", () => download(watched?.error_file_id, "errors"));
  $("jobs-refresh").addEventListener("click", listBatches);
}

export function showJobs() {
  listBatches();
}

// Ten chat requests in the Batch API's line format, to try it without a file at hand.
function sampleFile() {
  const topics = ["tea", "rivers", "owls", "bridges", "jazz", "glaciers", "maps", "bees", "salt", "kites"];
  const lines = topics.map((topic, i) =>
    JSON.stringify({
      custom_id: `sample-${i}`,
      method: "POST",
      url: "/v1/chat/completions",
      body: { model: server.model, messages: [{ role: "user", content: `One sentence about ${topic}.` }], max_tokens: 32 },
    }),
  );
  return new File([lines.join("\n") + "\n"], "sample-batch.jsonl", { type: "application/jsonl" });
}

// The endpoint the batch must name: its first line's url.
async function endpointOf(file) {
  const head = await file.slice(0, 65536).text();
  try {
    return JSON.parse(head.split("\n", 1)[0]).url || "/v1/chat/completions";
  } catch {
    return "/v1/chat/completions"; // the server's validation will name the bad line
  }
}

async function run(file) {
  showError($("jobs-error"), null);
  $("jobs-start").disabled = $("jobs-sample").disabled = true;
  try {
    const form = new FormData();
    form.append("purpose", "batch");
    form.append("file", file, file.name);
    const uploaded = await callJson("/v1/files", { method: "POST", body: form });
    const batch = await callJson("/v1/batches", {
      method: "POST",
      json: { input_file_id: uploaded.id, endpoint: await endpointOf(file), completion_window: "24h" },
    });
    watch(batch);
  } catch (err) {
    showError($("jobs-error"), err);
  } finally {
    $("jobs-start").disabled = $("jobs-sample").disabled = false;
  }
}

function watch(batch) {
  const isNews = watched?.id !== batch.id || watched?.status !== batch.status;
  watched = batch;
  clearTimeout(timer);
  render(batch);
  if (isNews) listBatches();
  if (!FINAL.has(batch.status)) timer = setTimeout(poll, POLL_MS);
}

async function poll() {
  if (!watched) return;
  try {
    watch(await callJson(`/v1/batches/${encodeURIComponent(watched.id)}`));
  } catch (err) {
    showError($("jobs-error"), err);
    timer = setTimeout(poll, POLL_MS);
  }
}

function render(batch) {
  $("job").hidden = false;
  $("job-id").textContent = batch.id;
  $("job-status").textContent = batch.status;
  $("job-status").dataset.status = batch.status;
  const counts = batch.request_counts ?? { total: 0, completed: 0, failed: 0 };
  const done = counts.completed + counts.failed;
  $("job-progress").max = Math.max(1, counts.total);
  $("job-progress").value = done;
  $("job-counts").textContent = `${counts.completed} completed, ${counts.failed} failed of ${counts.total} lines`;
  $("job-cancel").disabled = FINAL.has(batch.status) || batch.status === "cancelling";
  $("job-output").disabled = !batch.output_file_id;
  $("job-errors").disabled = !batch.error_file_id;
  const failure = batch.errors?.data?.[0];
  if (failure) showError($("jobs-error"), { message: failure.message, param: failure.param ?? null });
}

async function cancel() {
  if (!watched) return;
  try {
    watch(await callJson(`/v1/batches/${encodeURIComponent(watched.id)}/cancel`, { method: "POST" }));
  } catch (err) {
    showError($("jobs-error"), err);
  }
}

// The file's content fetched with the key, then saved through a temporary object URL.
async function download(fileId, kind) {
  if (!fileId) return;
  try {
    const blob = await (await call(`/v1/files/${encodeURIComponent(fileId)}/content`)).blob();
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = `${watched.id}-${kind}.jsonl`;
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 10000);
  } catch (err) {
    showError($("jobs-error"), err);
  }
}

async function listBatches() {
  let page;
  try {
    page = await callJson("/v1/batches?limit=10");
  } catch {
    return; // the error, if any, shows where the user acts
  }
  const rows = page.data.map((batch) => {
    const row = document.createElement("tr");
    const counts = batch.request_counts ?? { total: 0, completed: 0, failed: 0 };
    const cells = [batch.id, batch.status, `${counts.completed + counts.failed} / ${counts.total}`];
    for (const text of cells) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.append(cell);
    }
    const action = document.createElement("td");
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = "Show";
    button.setAttribute("aria-label", `show batch ${batch.id}`);
    button.addEventListener("click", () => watch(batch));
    action.append(button);
    row.append(action);
    return row;
  });
  $("jobs-list").replaceChildren(...rows);
}
