// The stepserve console: a playground over the images API and a live view of the engine's batch, fed by
// GET /v1/engine/events (Server-Sent Events read with fetch, so the API key can go in a header).
"use strict";

const $ = (id) => document.getElementById(id);
const RECENT = 500;  // finished requests kept for the latency view
let apiKey = null;  // only ever in this variable: never stored, never in the URL
let recent = [];  // [status, latency_s, steps]

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
  const nets = m.controlnets || [];  // the ControlNets served (--controlnet-dir); none: no ControlNet fields
  for (const name of nets) $("control-name").add(new Option(name, name));
  $("control-set").hidden = nets.length === 0;
  const adapters = m.ip_adapters || [];  // the IP-Adapters served (--ip-adapter-dir); none: no image prompt fields
  for (const name of adapters) $("ip-name").add(new Option(name, name));
  $("ip-set").hidden = adapters.length === 0;
}

function readDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function imagePrompt() {
  // the request's `ip_adapter` from the image prompt fields, or null when none is chosen
  const name = $("ip-name").value;
  if ($("ip-set").hidden || !name) return null;
  const file = $("ip-image").files[0];
  if (!file) throw new Error(`IP-Adapter ${name}: choose an image for the image prompt`);
  return {name, image: await readDataURL(file), scale: Number($("ip-scale").value)};
}

async function controls() {
  // the request's `controls` from the ControlNet fields, or null when none is chosen
  const name = $("control-name").value;
  if ($("control-set").hidden || !name) return null;
  const file = $("control-image").files[0];
  if (!file) throw new Error(`ControlNet ${name}: choose a control image`);
  const control = {name, image: await readDataURL(file), scale: Number($("control-scale").value)};
  if ($("control-canny").checked) control.preprocess = "canny";
  return [control];
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
  try {
    const chosen = await controls();
    if (chosen) body.controls = chosen;
    const prompt = await imagePrompt();
    if (prompt) body.ip_adapter = prompt;
  } catch (e) {
    fail(cards, e.message);
    return;
  }
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
