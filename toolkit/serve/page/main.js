// The page's wiring: the plan (drawn by plan.js), the document read on the server, questions streamed.
// Everything a document or a model says is inserted as text (textContent), never as markup.
import { HttpError, NeedKey, call, setKey, stream } from "./api.js";
import { drawPlan } from "./plan.js";

const $ = (id) => document.getElementById(id);
let info = null; // GET /page/plan: the served plan and the server's limits
let held = null; // the document the server holds, as it has it: every question starts with it
let following = false;

function say(id, e) {
  $(id).textContent = e ? String(e.message || e) : "";
}

// Runs `fn`, showing its failure under `where`; a missing key opens the key form instead.
async function guarded(where, fn) {
  say(where, null);
  try {
    await fn();
  } catch (e) {
    if (e instanceof NeedKey) $("key-form").hidden = false;
    say(where, e);
  }
}

async function start() {
  await guarded("plan-error", loadPlan);
  await guarded("doc-error", loadDocument);
}

// --- the plan --------------------------------------------------------------------------------

async function loadPlan() {
  info = await call("/page/plan");
  $("model").textContent = info.plan.model;
  $("ctx").value = info.plan.n_ctx;
  drawPlan($("plan"), info.plan, "served");
}

$("replan").addEventListener("submit", (ev) => {
  ev.preventDefault();
  guarded("plan-error", async () => {
    const body = {};
    const ctx = $("ctx").value.trim();
    if (ctx) body.n_ctx = Number(ctx);
    if ($("kv").value) body.kv = $("kv").value;
    if ($("gpus").value.trim()) body.gpus = $("gpus").value.trim();
    $("plan").setAttribute("aria-busy", "true");
    try {
      const r = await call("/page/plan", { method: "POST", body });
      drawPlan($("plan"), r.plan, "what if");
    } finally {
      $("plan").removeAttribute("aria-busy");
    }
  });
});

$("served").addEventListener("click", () => {
  say("plan-error", null);
  if (info) drawPlan($("plan"), info.plan, "served");
});

// --- the document ----------------------------------------------------------------------------

function fmt(n) {
  return Number(n).toLocaleString("en");
}

function showReading(s) {
  const bar = $("read-progress");
  bar.max = Math.max(1, s.tokens);
  bar.value = s.done;
  let text = "No document has been read yet.";
  if (s.state === "reading") {
    const left = s.eta_s === null ? "time left: estimating" : `${s.eta_s.toFixed(1)} s left`;
    text = `${fmt(s.done)} of ${fmt(s.tokens)} tokens read · ${fmt(s.rate)} tokens/s · ${left}`;
  } else if (s.state === "read") {
    const reused = s.reused ? ` (${fmt(s.reused)} of them held already)` : "";
    text = `Read ${fmt(s.tokens)} tokens${reused} in ${s.elapsed_s.toFixed(1)} s, ${fmt(s.rate)} tokens/s; ` +
           "held for the questions.";
  } else if (s.state === "failed") {
    text = `The reading failed: ${s.error}`;
  }
  $("read-status").textContent = text;
  $("read-status").dataset.state = s.state;
}

function hold(text) {
  held = text;
  $("doc-held").textContent = text;
  $("doc-shown").hidden = text === null;
}

async function loadDocument() {
  const s = await call("/page/document");
  showReading(s);
  hold(s.state === "read" ? s.text : null);
  if (s.state === "reading") follow();
}

// Streams the job's progress until it ends; a dropped stream (a reload, a network hiccup) is picked up again.
async function follow() {
  if (following) return;
  following = true;
  try {
    for (let tries = 0; tries < 30; tries++) {
      let last = null;
      try {
        // the final state is shown by loadDocument, with the text it holds: "read" never shows before the text is held
        await stream("/page/document/events", { onData: (s) => { last = s; if (s.state === "reading") showReading(s); } });
      } catch (e) {
        if (e instanceof NeedKey || e instanceof HttpError) throw e;
        await new Promise((r) => setTimeout(r, 1000));
        continue;
      }
      if (last && last.state !== "reading") break;
    }
    await loadDocument();
  } catch (e) {
    say("doc-error", e);
  } finally {
    following = false;
  }
}

$("doc-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  guarded("doc-error", async () => {
    const file = $("doc-file").files[0];
    const text = file ? await file.text() : $("doc-text").value;
    if (!text.trim()) throw new Error("Choose a file or paste the document's text first.");
    const size = new Blob([text]).size;
    if (info && size > info.max_body) {
      throw new Error(`The document is ${fmt(size)} bytes; this server takes at most ${fmt(info.max_body)} ` +
                      "bytes in a request (--max-body).");
    }
    hold(null);
    const s = await call("/page/document", { method: "POST", body: text, type: "text/plain; charset=utf-8" });
    if (s.state === "reading") showReading(s); // an ended read is shown by follow's loadDocument, its text held
    follow();
  });
});

// --- questions -------------------------------------------------------------------------------

function ask(question, maxTokens) {
  const article = document.createElement("article");
  const q = document.createElement("p");
  q.className = "question";
  q.textContent = question;
  const answer = document.createElement("p");
  answer.className = "answer";
  const stats = document.createElement("p");
  stats.className = "stats";
  stats.textContent = "waiting for the first token…";
  article.append(q, answer, stats);
  $("answers").append(article);

  const body = {
    messages: [{ role: "user", content: `${held}\n\n${question}` }],
    stream: true, stream_options: { include_usage: true }, max_tokens: maxTokens, temperature: 0,
  };
  const t0 = performance.now();
  let first = null;
  let pieces = 0;
  let usage = null;
  let timings = null;
  return stream("/v1/chat/completions", {
    method: "POST", body,
    onData: (c) => {
      if (c.error) throw new Error(c.error.message);
      if (c.usage) usage = c.usage;
      if (c.timings) timings = c.timings;
      const piece = c.choices && c.choices[0] && c.choices[0].delta && c.choices[0].delta.content;
      if (piece) {
        if (first === null) first = performance.now();
        pieces += 1;
        answer.textContent += piece;
      }
    },
  }).then(() => {
    const end = performance.now();
    const ttft = ((first === null ? end : first) - t0) / 1000;
    const n = usage ? usage.completion_tokens : pieces;
    const gen = first === null ? 0 : (end - first) / 1000;
    const parts = [];
    if (usage) {
      const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
      const read = usage.prompt_tokens - cached;
      parts.push(`prompt tokens read: ${fmt(read)} (of ${fmt(usage.prompt_tokens)}, ${fmt(cached)} held)`);
      stats.dataset.read = String(read);
    } else {
      parts.push("prompt tokens read: not reported by this server");
    }
    parts.push(`time to first token: ${ttft.toFixed(2)} s`);
    parts.push(`${gen > 0 ? (n / gen).toFixed(1) : "–"} tokens/s (${fmt(n)} tokens)`);
    if (timings && timings.draft_n !== undefined) {
      parts.push(`drafted ${fmt(timings.draft_n)}, accepted ${fmt(timings.draft_n_accepted)}`);
    }
    stats.textContent = parts.join(" · ");
    stats.dataset.ttft = String(ttft);
  }, (e) => {
    stats.textContent = `failed: ${e.message || e}`;
    throw e;
  });
}

$("ask-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  guarded("ask-error", async () => {
    const question = $("question").value.trim();
    if (!question) throw new Error("Write a question first.");
    if (held === null) throw new Error("Read a document first: every question is about it.");
    await ask(question, Number($("max-tokens").value) || 256);
  });
});

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  setKey($("key").value);
  $("key").value = "";
  $("key-form").hidden = true;
  start();
});

start();
