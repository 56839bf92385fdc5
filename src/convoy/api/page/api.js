// Talking to the server: the API key (session storage only), fetch with the key, the server's
// OpenAI errors as it worded them, and server-sent events.

const KEY_NAME = "convoy.apiKey";

export const server = { model: "" }; // the served model's id, from GET /v1/models

export function getKey() {
  return sessionStorage.getItem(KEY_NAME) || "";
}

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY_NAME, key);
  else sessionStorage.removeItem(KEY_NAME);
}

// An error the server answered: its status and OpenAI error object ({message, type, param, code}).
export class ServerError extends Error {
  constructor(status, error) {
    super(error.message);
    this.status = status;
    this.param = error.param ?? null;
    this.code = error.code ?? null;
  }

  static async of(response) {
    const text = await response.text();
    let error = { message: text || response.statusText };
    try {
      const body = JSON.parse(text);
      if (body && typeof body.error === "object" && body.error) error = body.error;
    } catch {
      // not JSON: the text as it came
    }
    return new ServerError(response.status, error);
  }
}

// fetch(path) with the key; JSON bodies by `json`. Throws ServerError for any non-2xx answer.
export async function call(path, { method = "GET", json, body, signal } = {}) {
  const headers = {};
  const key = getKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  const response = await fetch(path, { method, headers, body, signal });
  if (!response.ok) {
    const err = await ServerError.of(response);
    if (err.status === 401) document.dispatchEvent(new CustomEvent("convoy:unauthorized"));
    throw err;
  }
  return response;
}

export async function callJson(path, options) {
  return (await call(path, options)).json();
}

// The `data:` payloads of a server-sent event stream, parsed, until `[DONE]`. An error frame
// (an error after the stream started) is thrown as a ServerError.
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) throw new ServerError(payload.error.status ?? 0, payload.error);
      yield payload;
    }
  }
}

// Show `err` in `box` (a .error element): the server's message and param as it sent them.
export function showError(box, err) {
  box.replaceChildren();
  if (!err) {
    box.hidden = true;
    return;
  }
  const status = document.createElement("span");
  status.className = "status";
  const message = document.createElement("span");
  message.className = "message";
  message.textContent = err.message;
  if (err instanceof ServerError) {
    status.textContent = err.status ? `${err.status}` : "error";
  } else if (err instanceof TypeError) {
    status.textContent = "network";
    message.textContent = `could not reach the server (${err.message})`;
  } else {
    status.textContent = "error";
  }
  box.append(status, message);
  if (err.param) {
    const param = document.createElement("span");
    param.className = "param";
    param.textContent = `param: ${err.param}`;
    box.append(param);
  }
  box.hidden = false;
}

export function isAbort(err) {
  return err instanceof DOMException && err.name === "AbortError";
}
