// The stepserve console on a server of several models (console.js starts it when GET /v1/models lists more than
// one): the models in the header, one events stream per model loaded (/v1/engine/events?model=NAME; none for a
// model on disk, so watching loads nothing), followed by looking at /v1/models every few seconds, a lane group per
// model (lanes.js), a colour per model for the device strip, and the playground's model selector.
"use strict";

const MODELS_EVERY_MS = 3000;  // how often the page looks at /v1/models
let several = false;  // a server of several models
let models = [];  // its /v1/models cards, in its order
const infoOf = new Map();  // model -> its hello's model (sizes and defaults: the playground's form)
let polling = null;

const MODEL_COLOURS = ["#8e44ad", "#e67e22", "#16a085", "#b7950b", "#34495e", "#d35400"];  // apart from the lanes'

function modelColour(name) {  // one colour per model, in /v1/models' order
  const i = models.findIndex((m) => m.id === name);
  return MODEL_COLOURS[(i < 0 ? 0 : i) % MODEL_COLOURS.length];
}

function showModels(list) {  // the header, the playground's selector, a lane group per model, the device legend
  models = list;
  $("model").textContent = `${list.length} models: ` + list.map((m) => `${m.id}${m.family ? ` (${m.family})` : ""}` +
                                                                    (m.default ? " default" : "")).join(" · ");
  const choice = $("model-choice"), chosen = choice.value;
  if ([...choice.options].map((o) => o.value).join() !== list.map((m) => m.id).join()) {
    choice.replaceChildren(...list.map((m) => new Option(m.id, m.id, false, chosen ? m.id === chosen : m.default)));
    chooseModel();
  }
  $("model-label").hidden = false;
  $("device-view").hidden = false;
  for (const m of list) group(m.id, "model");  // in the server's order, loaded or not
  for (const m of list) {  // a stream for each model loaded; none for a model on disk (watching it loads nothing)
    const loaded = m.place !== "disk" && !(m.memory && m.memory.loading);
    if (loaded && !streams.has(m.id)) connectEvents(m.id);
    else if (!loaded && streams.has(m.id)) { streams.get(m.id).abort(); streams.delete(m.id); }
  }
  showReplicas();
  showDevice();
}

async function refreshModels() {
  try {
    const answer = await fetch("/v1/models", {headers: headers()});
    if (answer.ok) showModels((await answer.json()).data || []);
  } catch (e) { /* the server is away: the streams say so */ }
}

function chooseModel() {  // the playground's form for the chosen model: its own sizes and defaults once it is loaded
  const name = $("model-choice").value, m = infoOf.get(name);
  if (m) { fillForm(m, name); return; }
  formFor = null;
  for (const id of ["size", "sampler"]) $(id).replaceChildren(new Option("the model's default", ""));
  for (const id of ["steps", "guidance"]) { $(id).value = ""; $(id).placeholder = "the model's default"; }
  $("negative-label").hidden = $("control-set").hidden = $("ip-set").hidden = true;
  const card = models.find((x) => x.id === name);
  $("model-note").hidden = !(card && card.place === "disk");  // a loaded one's stream brings its form at once
  $("model-note").textContent = `${name} is on disk: its first request loads it (its sizes and defaults show ` +
                                `here once it is loaded)`;
}
