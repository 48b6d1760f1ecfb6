// The /inspect page: POST /v1/inspect, then one heatmap per layer and head on one color scale, a
// tooltip per cell and the heads' statistics. Plain JS, no dependency: the gateway serves this file.
"use strict";

const $ = (id) => document.getElementById(id);
const STATISTICS = ["entropy", "mean_distance", "first_position_share", "previous_token_share"];
const LOW = [255, 255, 255], HIGH = [8, 48, 107]; // white to dark blue
let scaleMax = 1; // the largest weight of the maps shown: the top of the one color scale

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

async function modelWidth() {
  const listed = await api("GET", "/v1/models");
  const model = listed.models.find((m) => m.d_model);
  if (!model) throw new Error("no ready model gives its d_model (GET /v1/models)");
  return model.d_model;
}

async function requestBody() {
  const body = {};
  const pasted = $("hidden").value.trim();
  if (pasted) {
    try { body.hidden_states = JSON.parse(pasted); } catch (error) {
      throw new Error("hidden states: not valid JSON (" + error.message + ")");
    }
  } else {
    const count = parseInt($("tokens").value, 10), seed = parseInt($("seed").value, 10);
    if (!(count >= 1 && count <= 256)) throw new Error("tokens: expected a whole number from 1 to 256");
    if (!Number.isFinite(seed)) throw new Error("seed: expected a whole number");
    body.hidden_states = randomTokens(count, await modelWidth(), seed);
  }
  const session = $("session").value.trim();
  if (session) body.session = session;
  return body;
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
    document.body.dataset.state = "done";
  } catch (error) {
    showError(error.message);
  } finally {
    $("inspect").disabled = false;
  }
}

function draw(answer) {
  scaleMax = answer.maps.flat(3).reduce((a, b) => Math.max(a, b), 1e-12);
  const cell = Math.max(2, Math.min(16, Math.floor(128 / answer.keys)));
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
    canvas.addEventListener("mousemove", (e) => hover(e, weights, l, h, cell));
    canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
    box.appendChild(canvas);
    grid.appendChild(box);
  }));
  legend();
  $("summary").textContent = answer.layers + " layers x " + answer.heads + " heads, " + answer.queries +
    " queries x " + answer.keys + " keys";
}

function hover(event, weights, l, h, cell) {
  const i = Math.floor(event.offsetY / cell), j = Math.floor(event.offsetX / cell);
  const row = weights[i];
  if (!row || row[j] === undefined) return;
  const tip = $("tooltip");
  tip.textContent = "layer " + l + ", head " + h + ", query " + i + ", key " + j + ": weight " + row[j].toFixed(4);
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

function table(statistics) {
  const titles = ["layer", "head", "entropy (nats)", "mean distance", "first position", "previous token"];
  const rows = [titles.map((t) => "<th>" + t + "</th>").join("")];
  for (const layer of statistics) {
    for (const head of layer.heads) {
      const cells = [layer.layer, head.head, ...STATISTICS.map((s) => (head[s] === null ? "-" : head[s].toFixed(3)))];
      rows.push(cells.map((c) => "<td>" + c + "</td>").join(""));
    }
  }
  $("stats").innerHTML = rows.map((r) => "<tr>" + r + "</tr>").join("");
}

$("form").addEventListener("submit", inspect);
