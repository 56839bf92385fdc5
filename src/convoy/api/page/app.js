// The page: tabs, the API key, the served model; the side-by-side view starts itself once a
// browser session, so a first visit shows 8 prompts generated at once.

import { callJson, getKey, server, setKey, showError } from "./api.js";
import { initBatch, startBatch } from "./batch.js";
import { initChat } from "./chat.js";
import { initJobs, showJobs } from "./jobs.js";
import { refresh, startNumbers } from "./numbers.js";

const AUTOSTARTED = "convoy.autostarted"; // session storage: the first generation has run
const VIEWS = ["batch", "chat", "jobs"];
const $ = (id) => document.getElementById(id);

function showView(name) {
  if (!VIEWS.includes(name)) name = "batch";
  for (const view of VIEWS) {
    const isShown = view === name;
    $(`view-${view}`).hidden = !isShown;
    $(`tab-${view}`).setAttribute("aria-selected", String(isShown));
    $(`tab-${view}`).tabIndex = isShown ? 0 : -1;
  }
  if (name === "jobs") showJobs();
}

function initTabs() {
  for (const view of VIEWS) {
    $(`tab-${view}`).addEventListener("click", () => {
      history.replaceState(null, "", `#${view}`);
      showView(view);
    });
  }
  $("tabs").addEventListener("keydown", (event) => {
    const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
    if (!step) return;
    const current = VIEWS.findIndex((v) => $(`tab-${v}`).getAttribute("aria-selected") === "true");
    const next = VIEWS[(current + step + VIEWS.length) % VIEWS.length];
    $(`tab-${next}`).click();
    $(`tab-${next}`).focus();
  });
  window.addEventListener("hashchange", () => showView(location.hash.slice(1)));
  showView(location.hash.slice(1));
}

function initKey() {
  $("api-key").value = getKey();
  $("key-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    setKey($("api-key").value.trim());
    await connect();
  });
  document.addEventListener("convoy:unauthorized", () => $("key-form").classList.add("needed"));
}

// Ask the server for its model with the key given; on success read the numbers once (the
// baseline for tokens/s) and run the first generation if this session has not yet.
async function connect() {
  try {
    const models = await callJson("/v1/models");
    server.model = models.data[0]?.id ?? "";
  } catch (err) {
    $("model").textContent = "";
    showError($("key-error"), err);
    if (err.status === 401) $("api-key").focus();
    return;
  }
  showError($("key-error"), null);
  $("key-form").classList.remove("needed");
  $("model").textContent = server.model;
  await refresh();
  if (!sessionStorage.getItem(AUTOSTARTED)) {
    sessionStorage.setItem(AUTOSTARTED, "yes");
    if ($("tab-batch").getAttribute("aria-selected") === "true") startBatch();
  }
}

initTabs();
initKey();
initBatch();
initChat();
initJobs();
startNumbers();
connect();
