// Calls to the server that served this page. The API key (--api-key), when the server asks for one, is kept
// in sessionStorage: this tab only, gone when it closes.

const KEY = "ctxq-api-key";

export class NeedKey extends Error {}

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function setKey(key) {
  sessionStorage.setItem(KEY, key);
}

function headers(extra) {
  const h = { ...(extra || {}) };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The server's error message (OpenAI's shape, {"error": {"message"}}), or the status.
async function failure(r) {
  let message = `${r.status} ${r.statusText}`;
  try {
    const body = await r.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  if (r.status === 401) return new NeedKey(message);
  return new HttpError(r.status, message);
}

export async function call(path, { method = "GET", body, type = "application/json", signal } = {}) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": type }), signal };
  if (body !== undefined) init.body = type === "application/json" ? JSON.stringify(body) : body;
  const r = await fetch(path, init);
  if (!r.ok) throw await failure(r);
  return r.json();
}

// POSTs or GETs `path` and hands each server-sent event's data to `onData` (parsed JSON; "[DONE]" ends).
// fetch, not EventSource: EventSource cannot send the Authorization header.
export async function stream(path, { method = "GET", body, onData, signal } = {}) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
                 signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  if (!r.ok) throw await failure(r);
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer = (buffer + value).replace(/\r\n/g, "\n");  // sse-starlette ends lines with CRLF
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}
