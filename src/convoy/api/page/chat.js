// Chat: a streamed conversation with the served model, a system prompt, the sampling fields and
// structured outputs (a JSON schema through response_format, a regex through structured_outputs).

import { call, events, isAbort, server, showError } from "./api.js";
import { mountSampling, readSampling } from "./sampling.js";

const EXAMPLES = {
  json: JSON.stringify(
    {
      type: "object",
      properties: { city: { type: "string" }, country: { type: "string" }, population: { type: "integer" } },
      required: ["city", "country", "population"],
    },
    null,
    2,
  ),
  regex: "(Yes|No), because [a-z ,]{10,60}\\.",
};

const $ = (id) => document.getElementById(id);
const conversation = []; // {role, content} of the turns so far
let controller = null;

export function initChat() {
  mountSampling($("chat-sampling"), "chat", { max_tokens: 256, temperature: 0.7 });
  $("chat-mode").addEventListener("change", onMode);
  $("chat-spec").addEventListener("input", () => ($("chat-spec").dataset.edited = "yes"));
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => controller?.abort());
  $("chat-clear").addEventListener("click", () => {
    conversation.length = 0;
    $("chat-log").replaceChildren();
    showError($("chat-error"), null);
  });
}

function onMode() {
  const mode = $("chat-mode").value;
  const spec = $("chat-spec");
  $("chat-spec-field").hidden = mode === "text";
  $("chat-spec-label").textContent = mode === "json" ? "JSON schema" : "regex (the whole reply matches it)";
  if (mode !== "text" && !spec.dataset.edited) spec.value = EXAMPLES[mode]; // an example to edit
}

// The structured-output fields of the request; a schema that is not JSON is the page's own error.
function constraint() {
  const mode = $("chat-mode").value;
  const spec = $("chat-spec").value;
  if (mode === "json") {
    let schema;
    try {
      schema = JSON.parse(spec);
    } catch (e) {
      throw new Error(`the JSON schema is not JSON: ${e.message}`);
    }
    return { response_format: { type: "json_schema", json_schema: { name: "reply", schema } } };
  }
  if (mode === "regex") return { structured_outputs: { regex: spec } };
  return {};
}

function bubble(role, text) {
  const item = document.createElement("li");
  item.className = `msg ${role}`;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const meta = document.createElement("span");
  meta.className = "meta";
  item.append(who, body, meta);
  $("chat-log").append(item);
  item.scrollIntoView({ block: "end" });
  return item;
}

async function send() {
  const text = $("chat-input").value;
  if (!text.trim() || controller) return;
  showError($("chat-error"), null);
  let body;
  try {
    const system = $("chat-system").value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...conversation];
    messages.push({ role: "user", content: text });
    body = {
      model: server.model,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      ...readSampling("chat"),
      ...constraint(),
    };
  } catch (err) {
    showError($("chat-error"), err);
    return;
  }
  conversation.push({ role: "user", content: text });
  bubble("user", text);
  $("chat-input").value = "";
  const reply = bubble("assistant", "");
  reply.classList.add("streaming");
  const out = reply.querySelector(".text");
  let chunks = 0;
  let finish = "";
  let usage = null;
  controller = new AbortController();
  setRunning(true);
  try {
    const response = await call("/v1/chat/completions", { method: "POST", json: body, signal: controller.signal });
    for await (const chunk of events(response)) {
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices) {
        const delta = choice.delta?.content ?? "";
        if (delta) {
          out.textContent += delta;
          reply.dataset.chunks = ++chunks;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (err) {
    if (isAbort(err)) finish = "stopped";
    else showError($("chat-error"), err);
  } finally {
    controller = null;
    setRunning(false);
    reply.classList.remove("streaming");
  }
  if (out.textContent) conversation.push({ role: "assistant", content: out.textContent });
  else if (!finish) {
    reply.remove(); // the server refused the request: the user's turn stays, without a reply
    conversation.pop();
    $("chat-log").lastElementChild?.remove();
    $("chat-input").value = text;
    return;
  }
  const tokens = usage ? `${usage.completion_tokens} tokens · ` : "";
  reply.querySelector(".meta").textContent = `${tokens}finish: ${finish || "none"}`;
  reply.dataset.finish = finish;
}

function setRunning(isRunning) {
  $("chat-send").disabled = isRunning;
  $("chat-stop").disabled = !isRunning;
}
