// The stepserve console: a playground over the images API and a live view of the engine's batch, fed by
// GET /v1/engine/events (Server-Sent Events read with fetch, so the API key can go in a header); on a server of
// several models, one stream per model loaded (models.js).
"use strict";

const $ = (id) => document.getElementById(id);
const RECENT = 500;  // finished requests kept for the latency view
let apiKey = null;  // only ever in this variable: never stored, never in the URL
let recentOf = new Map();  // stream ("" for a server of one model, else the model's name) -> [status, latency_s, steps]
const streams = new Map();  // stream -> the AbortController of its open (or reconnecting) events stream
const liveStreams = new Set();  // the streams that are connected now
let formFor = null;  // the stream whose model filled the playground's form

function keepRecent(key) {
  if (!recentOf.has(key)) recentOf.set(key, []);
  return recentOf.get(key);
}

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
  const list = answer.ok ? ((await answer.json()).data || []) : [];
  several = list.length > 1;
  if (!several) {
    if (!streams.has("")) connectEvents("");
    return;
  }
  showModels(list);
  if (polling === null) polling = setInterval(refreshModels, MODELS_EVERY_MS);
}

$("key-submit-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey = $("key-input").value.trim() || null;
  $("key-input").value = "";
  start();
});

// --- live batch ------------------------------------------------------------------------------------------------
function setStatus(key, live) {  // live while any stream is connected
  if (live) liveStreams.add(key); else liveStreams.delete(key);
  const any = liveStreams.size > 0;
  $("status").textContent = any ? "live" : "offline";
  $("status").classList.toggle("live", any);
}

async function connectEvents(key) {  // key: "" (the server's one stream) or a model's name
  const control = new AbortController();
  streams.set(key, control);
  const url = "/v1/engine/events" + (key ? `?model=${encodeURIComponent(key)}` : "");
  let retryMs = 2000;
  try {
    const answer = await fetch(url, {headers: headers(), signal: control.signal});
    if (answer.status === 401) {
      streams.delete(key);
      showKeyForm("The server refused that key.");
      return;
    }
    if (answer.status === 409 || answer.status === 404) {  // that model is not loaded (or not served) any more:
      streams.delete(key);  // the next look at /v1/models opens its stream again once it is
      return;
    }
    if (answer.status === 429) {  // the server feeds as many viewers as it will
      $("model").textContent = "too many viewers on this server: retrying";
      retryMs = 1000 * (Number(answer.headers.get("Retry-After")) || 10);
    } else {
      for await (const {event, data} of sse(answer)) {
        if (event === "hello") { hello(data, key); setStatus(key, true); }  // live once the page knows the model
        else if (event === "steps") data.forEach(step);
        else if (event === "replicas") keepReplicas(data.replicas);
      }
    }
  } catch (e) { /* the stream broke (or was closed here): reconnect below, unless closed on purpose */ }
  setStatus(key, false);
  setTimeout(() => { if (streams.get(key) === control) connectEvents(key); }, retryMs);
}

function hello(h, key) {
  const m = h.model;
  if (several) {  // the header lists the models; each model's own line is under the totals
    infoOf.set(key, m);
    const g = group(key, "model");
    Object.assign(g, {lanes: new Map(), slots: [], strategy: h.strategy});  // its short ids start again
    const strategies = new Set([...groups.values()].map((x) => x.strategy).filter((x) => x));
    $("live-strategy").textContent = strategies.size ? `strategy ${[...strategies].join(", ")}` : "";
    engineNow = Math.max(engineNow, h.t);  // the models' records share one clock (the device's)
  } else {
    const fleet = h.replicas ? ` · ${h.replicas.length} replica${h.replicas.length === 1 ? "" : "s"}` : "";
    $("model").textContent = m ? `${m.name} (${m.family}) · max batch ${h.max_batch_size}${fleet}`
                               : "no replica is up yet";
    $("live-strategy").textContent = h.strategy ? `strategy ${h.strategy}` : "";
    engineNow = h.t;
  }
  recentOf.set(key, h.recent.slice(-RECENT));
  if (h.replicas) keepReplicas(h.replicas);
  if (m && (!several || key === $("model-choice").value)) fillForm(m, key);
  drawLatency();
}

function fillForm(m, key) {
  if (formFor === key && $("size").options.length) return;  // keep what the user chose across reconnects
  formFor = key;
  $("model-note").hidden = true;
  for (const id of ["size", "sampler"]) $(id).replaceChildren();
  for (const id of ["control-name", "ip-name"]) $(id).replaceChildren(new Option("none", ""));
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

function drawLatency() {  // per step count; with several models, per model and step count
  const groups = new Map([["all", []]]);
  const lists = several ? [...recentOf.entries()] : [["", [...recentOf.values()].flat()]];
  for (const [model, list] of lists) {
    for (const [status, latency, steps] of list) {
      if (status !== "completed" || latency === null) continue;
      const k = model ? `${model} · ${steps}` : steps;
      if (!groups.has(k)) groups.set(k, []);
      groups.get(k).push(latency);
      groups.get("all").push(latency);
    }
  }
  const order = (k) => several ? [models.findIndex((m) => k.startsWith(`${m.id} · `)), Number(k.split(" · ").pop())]
                               : [0, k];
  const keys = [...groups.keys()].filter((k) => k !== "all").sort((a, b) => {
    const [a1, a2] = order(a), [b1, b2] = order(b);
    return a1 - b1 || a2 - b2;
  });
  $("latency-key").textContent = several ? "model · steps" : "steps";
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
  const body = {prompt: $("prompt").value, n, stream: true, partial_images: 2, response_format: "b64_json"};
  if (several) body.model = $("model-choice").value;
  if ($("size").value) body.size = $("size").value;  // none: a model not loaded yet, which takes its defaults
  if ($("steps").value !== "") body.num_inference_steps = Number($("steps").value);
  if ($("guidance").value !== "") body.guidance_scale = Number($("guidance").value);
  if ($("sampler").value) body.sampler = $("sampler").value;
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
    if (several) refreshModels();  // a model it loaded gets its stream now
  }
});

$("model-choice").addEventListener("change", chooseModel);

start();
