// The stepserve console's live batch view (console.js feeds it): one lane per request, grouped by replica
// behind several replicas, and under the lanes a strip per replica of its batch sizes, cap and queue.
"use strict";

const WINDOWS_S = [1, 2, 5, 10, 20, 30];  // the lane view shows about 60 steps: the first of these that holds them
// One group of lanes per replica ("" for a single server, whose records name none). Short ids are per replica.
let groups = new Map();  // replica -> {lanes, slots, history, last, steps}
//   lanes: short id -> {slot, cells: [[t, dt, progress or null when paused]], left, status}
//   slots: lane slot -> short id or null; history: [t, dt, batch, cap, queue] per step (the strip under the lanes)
//   last: the replica's latest record; steps: records seen
let engineNow = 0;  // the newest step's end: every replica's records share one clock (the hub's)
let windowS = 20;
let stepEma = null;  // smoothed step time, which picks the window
let counts = {joined: 0, left: 0};
let drawPending = false;

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
