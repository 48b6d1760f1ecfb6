// The /inspect page: POST /v1/inspect, then one heatmap per layer and head on one color scale, a
// tooltip per cell, the heads' statistics and the heads the answer names by role; a whole model's text
// is sent as text, and the tokens it encoded to label the axes; its random ids can be sent twice over
// (the induction share's test). Plain JS, no dependency: the gateway serves this file.
"use strict";

const $ = (id) => document.getElementById(id);
const STATISTICS = ["entropy", "mean_distance", "first_position_share", "previous_token_share"];
const INDUCTION = "induction_share"; // a whole model's stateless call only
const LOW = [255, 255, 255], HIGH = [8, 48, 107]; // white to dark blue
const MIN_LABELLED_CELL = 8; // px: a map whose cells are smaller names its tokens in the tooltip only
let scaleMax = 1; // the largest weight of the maps shown: the top of the one color scale
let model = null; // the stateless model's sizes, {dModel, vocab} (vocab: a whole model's), once known

// A seeded PRNG (mulberry32) and standard normals from it (Box-Muller): the same tokens for a seed.
function mulberry32(seed) {
  let a = seed >>> 0;
  return function () {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function randomTokens(count, dModel, seed) {
  const next = mulberry32(seed);
  const rows = [];
  for (let i = 0; i < count; i++) {
    const row = [];
    for (let k = 0; k < dModel; k++) {
      const u = 1 - next(), v = next();
      row.push(Math.round(Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v) * 1e4) / 1e4);
    }
    rows.push(row);
  }
  return rows;
}

// The color of weight w on the shared scale: [r, g, b], integers (what the canvas stores). The square
// root of w / scaleMax, as `python -m export inspect` draws (PowerNorm(0.5)): on a linear scale the
// weights spread over many keys all look white beside the 1.0 of the first query.
function color(w) {
  const t = Math.sqrt(Math.min(1, Math.max(0, w / scaleMax)));
  return LOW.map((low, c) => Math.round(low + (HIGH[c] - low) * t));
}

function headers() {
  const key = $("key").value.trim();
  const sent = { "Content-Type": "application/json" };
  if (key) sent.Authorization = "Bearer " + key;
  return sent;
}

// An API call; its error body's message (or what went wrong) as an Error.
async function api(method, path, body) {
  let response;
  try {
    response = await fetch(path, { method, headers: headers(), body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (error) {
    throw new Error("the gateway did not answer: " + error.message);
  }
  const text = await response.text();
  let answer = null;
  try { answer = JSON.parse(text); } catch (error) { /* not JSON: said below */ }
  if (!response.ok) {
    const detail = answer && answer.error ? answer.error.code + ": " + answer.error.message : text.slice(0, 300);
    throw new Error(response.status + " " + detail);
  }
  if (answer === null) throw new Error("the gateway's answer is not JSON");
  return answer;
}

function randomIds(count, vocab, seed) {
  const next = mulberry32(seed);
  return Array.from({ length: count }, () => Math.floor(next() * vocab));
}

// `count` random ids but id 0 (often a special token: BOS, padding), then the same again, as
// `python -m export inspect --repeat` draws them (not the same numbers: another generator).
function repeatedIds(count, vocab, seed) {
  const next = mulberry32(seed);
  const first = Array.from({ length: count }, () => 1 + Math.floor(next() * (vocab - 1)));
  return first.concat(first);
}

// The served model's sizes (GET /v1/models), and the form for it: a whole model (token ids in) gets the
// text box, and its pasted JSON is token ids.
async function describeModel() {
  const listed = await api("GET", "/v1/models");
  const found = listed.models.find((m) => m.kind === "stateless" && m.ready && (m.d_model || m.vocab_size));
  if (!found) throw new Error("no ready model gives its d_model (GET /v1/models)");
  model = { dModel: found.d_model, vocab: found.vocab_size || null };
  $("text-box").hidden = !model.vocab;
  $("repeat-box").hidden = !model.vocab;
  $("hidden-label").textContent = model.vocab
    ? "Token ids as JSON, (tokens,) or (1, tokens); empty: random ids from the seed"
    : "Hidden states as JSON, (tokens, d_model) or (1, tokens, d_model); empty: random tokens from the seed";
  document.body.dataset.model = model.vocab ? "whole" : "hidden";
  return model;
}

async function requestBody() {
  const { dModel, vocab } = model || (await describeModel());
  const body = {};
  const text = vocab ? $("text").value : "";
  const pasted = $("hidden").value.trim();
  const what = vocab ? "token ids" : "hidden states";
  if (text) {
    body.text = text;
  } else if (pasted) {
    try { body[vocab ? "input_ids" : "hidden_states"] = JSON.parse(pasted); } catch (error) {
      throw new Error(what + ": not valid JSON (" + error.message + ")");
    }
  } else {
    const count = parseInt($("tokens").value, 10), seed = parseInt($("seed").value, 10);
    if (!(count >= 1 && count <= 256)) throw new Error("tokens: expected a whole number from 1 to 256");
    if (!Number.isFinite(seed)) throw new Error("seed: expected a whole number");
    if (vocab) body.input_ids = $("repeat").checked ? repeatedIds(count, vocab, seed) : randomIds(count, vocab, seed);
    else body.hidden_states = randomTokens(count, dModel, seed);
  }
  const session = $("session").value.trim();
  if (session) body.session = session;
  return body;
}

// A token's text (the answer's `tokens[].text`) as an axis shows it, with no blank in it: a space as an
// open box, other spacing and control characters as escapes (\n, \u00a0), and bytes that are no whole
// character as their escapes (\xe4\xbd) without the answer's "bytes:". `python -m export inspect`
// labels its axes by the same rule (export/inspect_form.py token_label).
const ESCAPES = { "\n": "\\n", "\t": "\\t", "\r": "\\r" };
function tokenLabel(text) {
  if (text.startsWith("bytes:")) return text.slice("bytes:".length);
  let label = "";
  for (const char of text) {
    if (char === " ") label += "\u2423";
    else if (ESCAPES[char]) label += ESCAPES[char];
    else if (/[\p{Z}\p{C}]/u.test(char)) label += escaped(char);
    else label += char;
  }
  return label;
}

function escaped(char) {
  const code = char.codePointAt(0);
  return code <= 0xffff ? "\\u" + code.toString(16).padStart(4, "0") : "\\U" + code.toString(16).padStart(8, "0");
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
  document.body.dataset.state = "error";
}

async function inspect(event) {
  event.preventDefault();
  $("error").hidden = true;
  $("request-body").textContent = "";
  document.body.dataset.state = "loading";
  $("inspect").disabled = true;
  try {
    const body = await requestBody();
    $("request-body").textContent = JSON.stringify(body); // to repeat it: curl -d @request.json
    const answer = await api("POST", "/v1/inspect", body);
    draw(answer);
    table(answer.statistics);
    roles(answer.roles);
    document.body.dataset.state = "done";
  } catch (error) {
    showError(error.message);
  } finally {
    $("inspect").disabled = false;
  }
}

function draw(answer) {
  scaleMax = answer.maps.flat(3).reduce((a, b) => Math.max(a, b), 1e-12);
  const queries = answer.tokens ? answer.tokens.map((t) => tokenLabel(t.text)) : null;
  // maps with tokens to name get twice the room: a label needs a cell of MIN_LABELLED_CELL at least
  const cell = Math.max(2, Math.min(16, Math.floor((queries ? 256 : 128) / answer.keys)));
  // the tokens are the new ones: a session's past keys before them go unnamed
  const keys = queries ? Array(answer.keys - answer.queries).fill("").concat(queries) : null;
  const grid = $("maps");
  grid.replaceChildren();
  grid.style.gridTemplateColumns = "repeat(" + answer.heads + ", max-content)";
  answer.maps.forEach((layer, l) => layer.forEach((weights, h) => {
    const box = document.createElement("div");
    box.className = "map";
    box.textContent = "layer " + l + ", head " + h;
    const canvas = document.createElement("canvas");
    canvas.width = answer.keys * cell;
    canvas.height = answer.queries * cell;
    Object.assign(canvas.dataset, { layer: l, head: h, cell: cell });
    const context = canvas.getContext("2d");
    weights.forEach((row, i) => row.forEach((w, j) => {
      context.fillStyle = "rgb(" + color(w).join(",") + ")";
      context.fillRect(j * cell, i * cell, cell, cell);
    }));
    canvas.addEventListener("mousemove", (e) => hover(e, weights, l, h, cell, queries, keys));
    canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
    box.appendChild(queries && cell >= MIN_LABELLED_CELL ? labelled(canvas, queries, keys, cell) : canvas);
    grid.appendChild(box);
  }));
  legend();
  $("summary").textContent = answer.layers + " layers x " + answer.heads + " heads, " + answer.queries +
    " queries x " + answer.keys + " keys";
}

// The canvas with the tokens beside its rows (queries) and under its columns (keys), one per cell.
function labelled(canvas, queries, keys, cell) {
  const grid = document.createElement("div");
  grid.className = "labelled";
  grid.style.fontSize = Math.min(11, cell - 2) + "px";
  const column = (labels, className) => {
    const box = document.createElement("div");
    box.className = className;
    labels.forEach((label) => {
      const name = document.createElement("span");
      name.textContent = label;
      name.style[className === "query-labels" ? "height" : "width"] = cell + "px";
      name.style.lineHeight = cell + "px";
      box.appendChild(name);
    });
    return box;
  };
  grid.append(column(queries, "query-labels"), canvas, document.createElement("div"), column(keys, "key-labels"));
  return grid;
}

function hover(event, weights, l, h, cell, queries, keys) {
  const i = Math.floor(event.offsetY / cell), j = Math.floor(event.offsetX / cell);
  const row = weights[i];
  if (!row || row[j] === undefined) return;
  const tip = $("tooltip");
  const named = (label) => (label ? " (" + label + ")" : "");
  const query = "query " + i + named(queries && queries[i]), key = "key " + j + named(keys && keys[j]);
  tip.textContent = "layer " + l + ", head " + h + ", " + query + ", " + key + ": weight " + row[j].toFixed(4);
  Object.assign(tip.dataset, { layer: l, head: h, query: i, key: j });
  tip.hidden = false;
  const right = event.clientX + 12 + tip.offsetWidth > window.innerWidth; // near the edge: left of the pointer
  tip.style.left = (right ? event.clientX - 12 - tip.offsetWidth : event.clientX + 12) + "px";
  tip.style.top = event.clientY + 12 + "px";
}

function legend() {
  const canvas = $("legend"), context = canvas.getContext("2d");
  for (let x = 0; x < canvas.width; x++) {
    context.fillStyle = "rgb(" + color(scaleMax * x / (canvas.width - 1)).join(",") + ")";
    context.fillRect(x, 0, 1, canvas.height);
  }
  $("legend-high").textContent = scaleMax.toFixed(4);
  $("legend-box").hidden = false;
}

// The statistics, a row per layer and head; the induction column where the answer measured it.
function table(statistics) {
  const induction = statistics.some((layer) => layer.heads.some((head) => INDUCTION in head));
  const names = induction ? STATISTICS.concat(INDUCTION) : STATISTICS;
  const titles = ["layer", "head", "entropy (nats)", "mean distance", "first position", "previous token", "induction"];
  const rows = [titles.slice(0, 2 + names.length).map((t) => "<th>" + t + "</th>").join("")];
  for (const layer of statistics) {
    for (const head of layer.heads) {
      const cells = [layer.layer, head.head, ...names.map((s) => (head[s] === null ? "-" : head[s].toFixed(3)))];
      rows.push(cells.map((c) => "<td>" + c + "</td>").join(""));
    }
  }
  $("stats").innerHTML = rows.map((r) => "<tr>" + r + "</tr>").join("");
}

// The heads the answer names per role: "L0H3 (0.91), ...", "none found", or why it was not measured.
function roles(found) {
  const list = $("roles");
  list.replaceChildren();
  for (const role of found) {
    const item = document.createElement("li");
    item.dataset.role = role.role;
    const heads = role.heads.map((h) => "L" + h.layer + "H" + h.head + " (" + h.share.toFixed(2) + ")").join(", ");
    const named = role.measured ? heads || "none found" : "not measured";
    item.textContent = role.role + " heads (" + role.statistic + " \u2265 " + role.threshold + "): " + named;
    list.appendChild(item);
  }
  $("roles-box").hidden = false;
}

$("form").addEventListener("submit", inspect);
// the form fits the model once it is known: at once where auth is off, else once a key is given
$("key").addEventListener("change", () => describeModel().catch(() => {}));
describeModel().catch(() => {});
