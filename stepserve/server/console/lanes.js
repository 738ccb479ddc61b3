// The stepserve console's live batch view (console.js feeds it): one lane per request, grouped by replica
// behind several replicas and by model on a server of several models, and under the lanes a strip per group of its
// batch sizes, cap and queue; with several models, a strip of which model held the device at each step.
"use strict";

const WINDOWS_S = [1, 2, 5, 10, 20, 30];  // the lane view shows about 60 steps: the first of these that holds them
// One group of lanes per replica ("" for a single server, whose records name none), or per model on a server of
// several models. Short ids are per replica, per model.
let groups = new Map();  // replica or model -> {kind, lanes, slots, history, last, steps}
//   lanes: short id -> {slot, cells: [[t, dt, progress or null when paused]], left, status}
//   slots: lane slot -> short id or null; history: [t, dt, batch, cap, queue] per step (the strip under the lanes)
//   last: the replica's latest record; steps: records seen
let engineNow = 0;  // the newest step's end: every replica's records share one clock (the hub's)
let windowS = 20;
let stepEma = null;  // smoothed step time, which picks the window
let counts = {joined: 0, left: 0};
let drawPending = false;
let deviceSteps = [];  // several models: [t, dt, model] per step, in the order the device ran them
const deviceTotals = new Map();  // model -> {steps, seconds} the device gave it since the page opened

function keepReplicas(names) {  // the replicas now serving: a group each, in the order given (by name)
  for (const name of [...groups.keys()]) if (!names.includes(name)) groups.delete(name);
  for (const name of names) group(name);
  groups = new Map([...groups.entries()].sort((a, b) => a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
  showReplicas();
  if (!drawPending) { drawPending = true; requestAnimationFrame(drawLanes); }
}

function group(name, kind) {
  let g = groups.get(name);
  if (!g) {
    g = {kind: kind || "replica", lanes: new Map(), slots: [], history: [], last: null, steps: 0, strategy: null};
    groups.set(name, g);
  }
  return g;
}

function showReplicas() {  // a line per replica (or model) under the totals: its name, steps seen, latest numbers
  const box = $("live-replicas");
  const named = [...groups.entries()].filter(([name]) => name !== "");
  box.hidden = !named.length;
  box.replaceChildren(...named.map(([name, g]) => {
    const row = document.createElement("span");
    row.className = "replica";
    row.dataset[g.kind] = name;
    if (g.kind === "model") row.style.borderLeftColor = modelColour(name);
    const r = g.last;
    row.textContent = `${name}: ${g.steps} steps` + (r ? ` · queue ${r.queue} · running ${r.running} · batch ` +
                      `${r.rows.length}` : "");
    return row;
  }));
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
  const g = several && r.model ? group(r.replica ? `${r.model} · ${r.replica}` : r.model, "model")
                               : group(r.replica || "");
  engineNow = Math.max(engineNow, r.t + r.dt);
  if (several && r.model && r.dt > 0) {  // one device: its steps, whichever model's, on one time line
    deviceSteps.push([r.t, r.dt, r.model]);
    const total = deviceTotals.get(r.model) || {steps: 0, seconds: 0};
    deviceTotals.set(r.model, {steps: total.steps + 1, seconds: total.seconds + r.dt});
  }
  for (const id of r.joined) { lane(g, id, r.t); counts.joined += 1; }
  for (const [id, done, total] of r.rows) lane(g, id, r.t).cells.push([r.t, r.dt, done / total]);
  for (const id of r.paused) lane(g, id, r.t).cells.push([r.t, r.dt, null]);
  for (const [id, status, latency, steps] of r.done) {
    const l = g.lanes.get(id);
    if (l) { l.left = engineNow; l.status = status; }
    counts.left += 1;
    keepRecent(several ? r.model || "" : "").push([status, latency, steps]);
  }
  for (const [key, list] of recentOf) if (list.length > RECENT) recentOf.set(key, list.slice(-RECENT));
  if (r.rows.length) {
    stepEma = stepEma === null ? r.dt : 0.97 * stepEma + 0.03 * r.dt;
    windowS = WINDOWS_S.find((w) => w >= 60 * stepEma) || WINDOWS_S[WINDOWS_S.length - 1];
  }
  g.history.push([r.t, r.dt, r.rows.length, r.cap, r.queue]);
  g.last = r;
  g.steps += 1;
  while (deviceSteps.length && deviceSteps[0][0] < engineNow - WINDOWS_S[WINDOWS_S.length - 1]) deviceSteps.shift();
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
  if (several && r.model && r.dt > 0) showDevice();
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
      g.fillStyle = grp.kind === "model" ? modelColour(name.split(" · ")[0]) : "#1d2330";
      g.font = "bold 11px system-ui";
      g.fillText(`${grp.kind} ${name}`, 2, top + LABEL_H - 3);
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
  if (several) drawDevice(left, x);
}

function drawDevice(left, x) {  // several models: each step the device ran, in its model's colour
  const canvas = $("device"), g = canvas.getContext("2d"), W = canvas.width, H = canvas.height;
  g.clearRect(0, 0, W, H);
  for (const [t, dt, model] of deviceSteps) {
    if (t + dt < left) continue;
    g.fillStyle = modelColour(model);
    g.fillRect(x(t), 2, Math.max(1.5, dt / windowS * W - 0.5), H - 16);
  }
  axis(g, W, H, x, left);
}

function showDevice() {  // the strip's legend: each model's colour, where it is, the steps and time the device gave it
  $("device-legend").replaceChildren(...models.map((m) => {
    const item = document.createElement("span");
    item.className = "model";
    item.dataset.model = m.id;
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = modelColour(m.id);
    const total = deviceTotals.get(m.id) || {steps: 0, seconds: 0};
    item.append(swatch, `${m.id} (${m.place}): ${total.steps} steps, ${fmt(total.seconds)} on the device`);
    return item;
  }));
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
