// The plan drawn: one bar per device (each card, then the host), as `ctxq plan` lists them.
// No imports: `ctxq plan --html` inlines this module into a file that opens with no server.
// Everything from the plan is inserted as text (textContent), never as markup.

const CLASSES = {
  "weights": "seg-weights", "spilled weights": "seg-spilled", "KV cache": "seg-kv", "state": "seg-state",
  "compute": "seg-compute", "CUDA": "seg-cuda", "reserve": "seg-reserve", "free": "seg-free",
};

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function bar(device, widthPercent) {
  const row = el("div", "device");
  row.dataset.device = device.name;
  const label = el("div", "device-label");
  label.append(el("span", "device-name", device.name), el("span", "device-layers", device.layers),
               el("span", "device-figures", `total ${device.total_gib} GiB of ${device.capacity_gib} GiB`));
  const track = el("div", "track");
  const b = el("div", "bar");
  b.setAttribute("role", "img");
  b.setAttribute("aria-label", `${device.name}: ` +
                 device.segments.map((s) => `${s.name} ${s.gib} GiB`).join(", "));
  b.style.width = `${widthPercent}%`;  // CSSOM, which the page's Content-Security-Policy allows
  const capacity = Math.max(device.capacity, device.total, 1);
  for (const s of device.segments) {
    const seg = el("div", `seg ${CLASSES[s.name] || "seg-other"}`);
    seg.style.width = `${(100 * s.bytes) / capacity}%`;
    seg.title = `${s.name}: ${s.gib} GiB`;
    seg.dataset.segment = s.name;
    seg.dataset.bytes = String(s.bytes);
    b.append(seg);
  }
  track.append(b);
  row.append(label, track);
  return row;
}

function legend(devices) {
  const names = [];
  for (const d of devices) for (const s of d.segments) if (!names.includes(s.name)) names.push(s.name);
  const ul = el("ul", "legend");
  for (const n of names) {
    const li = el("li");
    li.append(el("span", `swatch ${CLASSES[n] || "seg-other"}`), document.createTextNode(n));
    ul.append(li);
  }
  return ul;
}

// Draws `view` (ctxq.serve.page_plan.view) into `container`, replacing what was there.
export function drawPlan(container, view, caption) {
  const cards = view.devices.filter((d) => !d.host);
  // the cards share one scale, so a card of half the memory draws half as long; the host's RAM dwarfs them
  // and gets a scale of its own
  const largest = Math.max(1, ...cards.map((d) => Math.max(d.capacity, d.total)));
  const head = el("p", "plan-head");
  const parallel = view.parallel ? `, ${view.parallel} sequences` : "";
  head.textContent = `${caption ? caption + ": " : ""}${view.model}, context ${view.n_ctx.toLocaleString("en")} ` +
                     `tokens${parallel}, KV ${view.type_k}/${view.type_v}`;
  const bars = el("div", "bars");
  for (const d of view.devices) {
    const width = d.host ? 100 : (100 * Math.max(d.capacity, d.total)) / largest;
    const row = bar(d, width);
    if (d.host && cards.length) row.querySelector(".device-layers").textContent += " (host, drawn to its own scale)";
    bars.append(row);
  }
  const flags = el("p", "flags");
  flags.append(document.createTextNode("llama.cpp flags: "), el("code", "", view.flags));
  const notes = el("ul", "notes");
  for (const n of view.notes) notes.append(el("li", "", n));
  if (view.reason) notes.append(el("li", "", `why: ${view.reason}`));
  container.replaceChildren(head, legend(view.devices), bars, flags, notes);
}
