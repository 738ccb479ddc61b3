// The stepserve console: a playground over the images API and a live view of the engine's batch, fed by
// GET /v1/engine/events (Server-Sent Events read with fetch, so the API key can go in a header).
"use strict";

const $ = (id) => document.getElementById(id);
const WINDOWS_S = [1, 2, 5, 10, 20, 30];  // the lane view shows about 60 steps: the first of these that holds them
const RECENT = 500;  // finished requests kept for the latency view
let apiKey = null;  // only ever in this variable: never stored, never in the URL
// One group of lanes per replica ("" for a single server, whose records name none). Short ids are per replica.
let groups = new Map();  // replica -> {lanes, slots, history, last, steps}
//   lanes: short id -> {slot, cells: [[t, dt, progress or null when paused]], left, status}
//   slots: lane slot -> short id or null; history: [t, dt, batch, cap, queue] per step (the strip under the lanes)
//   last: the replica's latest record; steps: records seen
let engineNow = 0;  // the newest step's end: every replica's records share one clock (the hub's)
let windowS = 20;
let stepEma = null;  // smoothed step time, which picks the window
let counts = {joined: 0, left: 0};
let recent = [];  // [status, latency_s, steps]
let drawPending = false;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

async function* sse(response) {  // the events of a text/event-stream body: {event, data}
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) yield {event, data: JSON.parse(data.join("\n"))};
    }
  }
}

// --- start and the API key -------------------------------------------------------------------------------------
function showKeyForm(message) {
  $("console").hidden = true;
  $("key-form").hidden = false;
  $("key-error").hidden = !message;
  $("key-error").textContent = message || "";
  $("key-input").focus();
}

async function start() {
  let answer;
  try {
    answer = await fetch("/v1/models", {headers: headers()});
  } catch (e) {
    $("model").textContent = "server unreachable";
    setTimeout(start, 2000);
    return;
  }
  if (answer.status === 401) {
    showKeyForm(apiKey ? "The server refused that key." : "");
    return;
  }
  $("key-form").hidden = true;
  $("console").hidden = false;
  connectEvents();
}

$("key-submit-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey = $("key-input").value.trim() || null;
  $("key-input").value = "";
  start();
});

// --- live batch ------------------------------------------------------------------------------------------------
function setStatus(live) {
  $("status").textContent = live ? "live" : "offline";
  $("status").classList.toggle("live", live);
}

async function connectEvents() {
  try {
    const answer = await fetch("/v1/engine/events", {headers: headers()});
    if (answer.status === 401) {
      showKeyForm("The server refused that key.");
      return;
    }
    if (answer.status === 429) {  // the server feeds as many viewers as it will
      $("model").textContent = "too many viewers on this server: retrying";
      setTimeout(connectEvents, 1000 * (Number(answer.headers.get("Retry-After")) || 10));
      return;
    }
    setStatus(true);
    for await (const {event, data} of sse(answer)) {
      if (event === "hello") hello(data);
      else if (event === "steps") data.forEach(step);
      else if (event === "replicas") keepReplicas(data.replicas);
    }
  } catch (e) { /* the stream broke: reconnect below */ }
  setStatus(false);
  setTimeout(connectEvents, 2000);
}

function hello(h) {
  const m = h.model;
  const fleet = h.replicas ? ` · ${h.replicas.length} replica${h.replicas.length === 1 ? "" : "s"}` : "";
  $("model").textContent = m ? `${m.name} (${m.family}) · max batch ${h.max_batch_size}${fleet}`
                             : "no replica is up yet";
  $("live-strategy").textContent = h.strategy ? `strategy ${h.strategy}` : "";
  engineNow = h.t;
  recent = h.recent.slice(-RECENT);
  if (h.replicas) keepReplicas(h.replicas);
  if (m) fillForm(m);
  drawLatency();
}

function keepReplicas(names) {  // the replicas now serving: a group each, in the order given (by name)
  for (const name of [...groups.keys()]) if (!names.includes(name)) groups.delete(name);
  for (const name of names) group(name);
  groups = new Map([...groups.entries()].sort((a, b) => a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
  showReplicas();
  if (!drawPending) { drawPending = true; requestAnimationFrame(drawLanes); }
}

function group(name) {
  let g = groups.get(name);
  if (!g) {
    g = {lanes: new Map(), slots: [], history: [], last: null, steps: 0};
    groups.set(name, g);
  }
  return g;
}

function showReplicas() {  // a line per replica under the totals: its name, steps seen and latest numbers
  const box = $("live-replicas");
  const named = [...groups.entries()].filter(([name]) => name !== "");
  box.hidden = !named.length;
  box.replaceChildren(...named.map(([name, g]) => {
    const row = document.createElement("span");
    row.className = "replica";
    row.dataset.replica = name;
    const r = g.last;
    row.textContent = `${name}: ${g.steps} steps` + (r ? ` · queue ${r.queue} · running ${r.running} · batch ` +
                      `${r.rows.length}` : "");
    return row;
  }));
}

function fillForm(m) {
  if ($("size").options.length) return;  // keep what the user chose across reconnects
  const sizes = new Set([`${m.default_width}x${m.default_height}`]);
  const stepPx = Math.max(m.size_multiple, Math.ceil((m.max_size - m.min_size) / 8 / m.size_multiple) * m.size_multiple);
  for (let s = m.min_size; s <= m.max_size; s += stepPx) sizes.add(`${s}x${s}`);
  for (const s of sizes) $("size").add(new Option(s, s, false, s === `${m.default_width}x${m.default_height}`));
  for (const s of m.samplers) $("sampler").add(new Option(s, s, false, s === m.default_sampler));
  $("steps").value = m.default_steps;
  $("steps").max = m.max_steps;
  $("guidance").value = m.default_guidance_scale;
  $("guidance").max = m.max_guidance_scale;
  $("negative-label").hidden = !m.negative_prompt;  // a family that takes none (e.g. distilled Flux) hides it
}

function lane(g, id, t) {
  let l = g.lanes.get(id);
  if (!l) {
    let slot = g.slots.indexOf(null);
    if (slot < 0) { slot = g.slots.length; g.slots.push(null); }
    g.slots[slot] = id;
    l = {slot, cells: [], left: null, status: null, joined: t};
    g.lanes.set(id, l);
  }
  return l;
}

function step(r) {
  const g = group(r.replica || "");
  engineNow = Math.max(engineNow, r.t + r.dt);
  for (const id of r.joined) { lane(g, id, r.t); counts.joined += 1; }
  for (const [id, done, total] of r.rows) lane(g, id, r.t).cells.push([r.t, r.dt, done / total]);
  for (const id of r.paused) lane(g, id, r.t).cells.push([r.t, r.dt, null]);
  for (const [id, status, latency, steps] of r.done) {
    const l = g.lanes.get(id);
    if (l) { l.left = engineNow; l.status = status; }
    counts.left += 1;
    recent.push([status, latency, steps]);
  }
  if (recent.length > RECENT) recent = recent.slice(-RECENT);
  if (r.rows.length) {
    stepEma = stepEma === null ? r.dt : 0.97 * stepEma + 0.03 * r.dt;
    windowS = WINDOWS_S.find((w) => w >= 60 * stepEma) || WINDOWS_S[WINDOWS_S.length - 1];
  }
  g.history.push([r.t, r.dt, r.rows.length, r.cap, r.queue]);
  g.last = r;
  g.steps += 1;
  for (const h of groups.values()) {
    while (h.history.length && h.history[0][0] < engineNow - WINDOWS_S[WINDOWS_S.length - 1]) h.history.shift();
    for (const [id, l] of h.lanes) {  // lanes that left the window free their slot
      if (l.left !== null && l.left < engineNow - windowS) { h.lanes.delete(id); h.slots[l.slot] = null; }
    }
    while (h.slots.length && h.slots[h.slots.length - 1] === null) h.slots.pop();
  }
  const latest = [...groups.values()].map((h) => h.last).filter((x) => x);  // totals over the replicas
  const sum = (f) => latest.reduce((n, x) => n + f(x), 0);
  $("live-queue").textContent = sum((x) => x.queue);
  $("live-running").textContent = sum((x) => x.running);
  $("live-batch").textContent = sum((x) => x.rows.length);
  $("live-cap").textContent = r.cap === null ? "–" : r.cap;
  $("live-step").textContent = `${(r.dt * 1000).toFixed(0)} ms`;
  $("live-joined").textContent = counts.joined;
  $("live-left").textContent = counts.left;
  showReplicas();
  if (r.done.length) drawLatency();
  if (!drawPending) { drawPending = true; requestAnimationFrame(drawLanes); }
}

function axis(g, W, H, x, left) {
  g.fillStyle = "#6b7385";
  g.font = "11px system-ui";
  const tick = windowS / 5;
  for (let k = 0; k <= 5; k++) g.fillText(`-${+(windowS - k * tick).toFixed(1)}s`, Math.min(W - 28, x(left + k * tick) + 2), H - 3);
}

const LABEL_H = 14;  // a replica's name above its lanes

function drawLanes() {
  drawPending = false;
  const canvas = $("lanes"), g = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, left = engineNow - windowS;
  const shown = [...groups.entries()];
  const labelled = shown.some(([name]) => name !== "");
  const rows = shown.reduce((n, [, grp]) => n + Math.max(1, grp.slots.length), 0);
  const laneH = Math.max(3, Math.min(16, (H - 16 - (labelled ? LABEL_H * shown.length : 0)) / Math.max(8, rows)));
  const x = (t) => (t - left) / windowS * W;
  g.clearRect(0, 0, W, H);
  axis(g, W, H, x, left);
  $("live-window").textContent = `the last ${windowS} s`;
  let top = 0;
  for (const [name, grp] of shown) {
    if (labelled) {
      g.fillStyle = "#1d2330";
      g.font = "bold 11px system-ui";
      g.fillText(`replica ${name}`, 2, top + LABEL_H - 3);
      g.fillStyle = "#e3e6ee";
      g.fillRect(0, top, W, 1);
      top += LABEL_H;
    }
    for (const l of grp.lanes.values()) {
      const y = top + l.slot * laneH;
      for (const [t, dt, p] of l.cells) {
        if (t + dt < left) continue;
        g.fillStyle = p === null ? "#c4c8d0" : `hsl(${215 - 75 * p}, 65%, ${55 - 13 * p}%)`;
        g.fillRect(x(t), y + 1, Math.max(1.5, dt / windowS * W - 0.5), laneH - 2);
      }
      if (l.left !== null) {
        g.fillStyle = l.status === "completed" ? "#2e9d5b" : "#c0392b";
        g.fillRect(x(l.left), y, 2, laneH);
      }
    }
    top += Math.max(1, grp.slots.length) * laneH;
  }
  drawHistory(left, x);
}

function drawHistory(left, x) {  // per replica, a band: batch size per step (bars), the cap in force, the queue
  const canvas = $("history"), g = canvas.getContext("2d"), W = canvas.width, H = canvas.height;
  g.clearRect(0, 0, W, H);
  const shown = [...groups.entries()];
  const bandH = (H - 16) / Math.max(1, shown.length);
  shown.forEach(([name, grp], i) => {
    const steps = grp.history.filter((h) => h[0] + h[1] >= left);
    const top = Math.max(1, ...steps.map((h) => Math.max(h[2], h[3] || 0, h[4])));
    const base = (i + 1) * bandH;
    const y = (v) => base - v / top * (bandH - 10);
    g.fillStyle = "#9db7e8";
    for (const [t, dt, n] of steps) g.fillRect(x(t), y(n), Math.max(1, dt / windowS * W - 0.5), base - y(n));
    for (const [index, colour] of [[3, "#2e9d5b"], [4, "#e67e22"]]) {
      g.strokeStyle = colour;
      g.beginPath();
      steps.forEach((h, j) => {
        if (h[index] !== null) j ? g.lineTo(x(h[0]), y(h[index])) : g.moveTo(x(h[0]), y(h[index]));
      });
      g.stroke();
    }
    g.fillStyle = "#6b7385";
    g.font = "11px system-ui";
    g.fillText(name ? `${name} · ${top}` : String(top), 2, base - bandH + 12);
  });
  axis(g, W, H, x, left);
}

// --- recent latency --------------------------------------------------------------------------------------------
function quantile(sorted, q) {
  if (!sorted.length) return null;
  const i = (sorted.length - 1) * q, lo = Math.floor(i), hi = Math.ceil(i);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (i - lo);
}

const fmt = (s) => s === null ? "–" : s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`;
const COLOURS = ["#2f6fde", "#e67e22", "#2e9d5b", "#8e44ad", "#c0392b", "#16a085"];

function drawLatency() {
  const groups = new Map([["all", []]]);
  for (const [status, latency, steps] of recent) {
    if (status !== "completed" || latency === null) continue;
    if (!groups.has(steps)) groups.set(steps, []);
    groups.get(steps).push(latency);
    groups.get("all").push(latency);
  }
  const keys = [...groups.keys()].filter((k) => k !== "all").sort((a, b) => a - b);
  const body = $("latency-table").tBodies[0];
  body.innerHTML = "";
  for (const k of [...keys, "all"]) {
    const v = groups.get(k).sort((a, b) => a - b);
    const row = body.insertRow();
    for (const cell of [k, v.length, fmt(quantile(v, .5)), fmt(quantile(v, .95)), fmt(quantile(v, .99))])
      row.insertCell().textContent = cell;
  }
  const canvas = $("cdf"), g = canvas.getContext("2d"), W = canvas.width, H = canvas.height;
  const all = groups.get("all");
  g.clearRect(0, 0, W, H);
  if (!all.length) return;
  const xmax = Math.max(...all) * 1.05, pad = 30;
  const x = (v) => pad + v / xmax * (W - pad - 10), y = (f) => H - pad - f * (H - pad - 10);
  g.strokeStyle = "#c9cfdb";
  g.fillStyle = "#6b7385";
  g.font = "11px system-ui";
  g.strokeRect(pad, 10, W - pad - 10, H - pad - 10);
  for (const f of [0.5, 0.95]) g.fillText(String(f), 2, y(f) + 4);
  g.fillText(fmt(xmax), W - 60, H - 10);
  g.fillText("latency", W / 2 - 20, H - 10);
  keys.forEach((k, i) => {
    const v = groups.get(k);
    g.strokeStyle = COLOURS[i % COLOURS.length];
    g.beginPath();
    v.forEach((s, j) => { const px = x(s), py = y((j + 1) / v.length); j ? g.lineTo(px, py) : g.moveTo(px, y(0)); g.lineTo(px, py); });
    g.stroke();
    g.fillStyle = g.strokeStyle;
    g.fillText(`${k} steps`, pad + 6, 22 + 14 * i);
  });
}

// --- playground ------------------------------------------------------------------------------------------------
function card(i) {
  const div = document.createElement("div");
  div.className = "result";
  div.innerHTML = `<img class="result-image" alt="image ${i + 1}"><div class="state">queued</div>` +
                  `<div class="timing"></div><div class="error" hidden></div>`;
  $("results").prepend(div);
  return div;
}

function fail(cards, message) {
  for (const c of cards) {
    if (c.querySelector("img").dataset.final) continue;
    c.querySelector(".state").textContent = "failed";
    const e = c.querySelector(".error");
    e.hidden = false;
    e.textContent = message;
  }
}

$("gen-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const n = Math.max(1, Number($("n").value) || 1);
  const body = {prompt: $("prompt").value, size: $("size").value, n, num_inference_steps: Number($("steps").value),
                guidance_scale: Number($("guidance").value), sampler: $("sampler").value, stream: true,
                partial_images: 2, response_format: "b64_json"};
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if (!$("negative-label").hidden && $("negative").value.trim() !== "") body.negative_prompt = $("negative").value;
  const cards = Array.from({length: n}, (_, i) => card(n - 1 - i)).reverse();
  $("generate").disabled = true;
  try {
    const answer = await fetch("/v1/images/generations", {method: "POST", body: JSON.stringify(body),
                                                          headers: headers({"Content-Type": "application/json"})});
    if (!answer.ok) {
      const text = await answer.text();
      let message = `HTTP ${answer.status}`;
      try { message += `: ${JSON.parse(text).error.message}`; } catch (e) { message += `: ${text.slice(0, 200)}`; }
      fail(cards, message);
      if (answer.status === 401) showKeyForm("The server refused that key.");
      return;
    }
    for await (const {event, data} of sse(answer)) {
      const info = data.stepserve || {};
      const c = cards[info.image_index || 0];
      if (event === "image_generation.partial_image" && c) {
        c.querySelector("img").src = `data:image/png;base64,${data.b64_json}`;
        c.querySelector(".state").textContent = `step ${info.step} of ${info.num_inference_steps}`;
      } else if (event === "image_generation.completed" && c) {
        const img = c.querySelector("img");
        img.src = `data:image/png;base64,${data.b64_json}`;
        img.dataset.final = "1";
        c.querySelector(".state").textContent = `done · seed ${info.seed}`;
        c.querySelector(".timing").textContent =
          `queued ${fmt(info.queue_s ?? null)} · denoising ${fmt(info.denoise_s ?? null)} · ` +
          `decoding ${fmt(info.decode_s ?? null)} · total ${fmt(info.total_s ?? null)}`;
      } else if (event === "error") {
        fail(cards, (data.error && data.error.message) || "the request failed");
      }
    }
  } catch (e) {
    fail(cards, `the connection broke: ${e}`);
  } finally {
    $("generate").disabled = false;
  }
});

start();
