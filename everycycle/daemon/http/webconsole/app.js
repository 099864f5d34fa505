// everycycle's console: the fleet, requests and activity live from /v1/events, a chat,
// the models, and usage. Everything shown is text (textContent, never HTML): model
// names, prompts and answers are data. No dependencies, nothing from the network.
"use strict";

const $ = (id) => document.getElementById(id);
let key = sessionStorage.getItem("everycycle-key") || "";
const positions = new Map();   // request id -> its last queue position (from events)
const finished = [];           // the last finished requests (from events)
let refreshTimer = null;
let running = 0;
const seenTokens = new Map();  // request id -> [tokens, when] at the last redraw (tokens/s)

function el(tag, attrs, ...kids) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) n.addEventListener(k.slice(2), v);
    else if (k === "class") n.className = v;
    else n.setAttribute(k, v);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) n.append(kid instanceof Node ? kid : String(kid));
  return n;
}

function short(id) {
  const n = el("span", { title: id }, id.length > 16 ? id.slice(0, 16) + "…" : id);
  return n;
}

// A table's rows, updated in place: a row (by its key, else its place) and a cell are
// replaced only where they changed, so a button under the pointer stays the same
// element while the table redraws around it (a click is never lost to a redraw).
function fill(id, rows, keys) {
  const body = $(id).tBodies[0];
  const old = new Map([...body.rows].map((tr) => [tr.dataset.key, tr]));
  const trs = rows.map((cells, i) => {
    const k = String(keys ? keys[i] : i);
    let tr = old.get(k);
    if (!tr) { tr = el("tr", {}); tr.dataset.key = k; }
    cells.forEach((c, j) => setCell(tr.cells[j] || tr.appendChild(el("td", {})), c));
    while (tr.cells.length > cells.length) tr.lastChild.remove();
    return tr;
  });
  trs.forEach((tr, i) => { if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null); });
  while (body.children.length > trs.length) body.lastChild.remove();
}

function setCell(td, c) {
  if (c instanceof Node) {
    if (td.childNodes.length !== 1 || !td.firstChild.isEqualNode(c)) td.replaceChildren(c);
  } else {
    const text = c === null || c === undefined ? "" : String(c);
    if (td.children.length || td.textContent !== text) td.textContent = text;
  }
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function age(ms) {
  const s = Math.round(ms / 1000);
  return s < 60 ? s + "s" : Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
}

function setStatus(text) { $("status").textContent = text; }
const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

async function api(path, opts) {
  opts = opts || {};
  const headers = Object.assign({}, opts.headers || {});
  if (key) headers["Authorization"] = "Bearer " + key;
  const r = await fetch(path, Object.assign({}, opts, { headers }));
  if (r.status === 401) {
    $("key-form").hidden = false;
    setStatus("this daemon wants an API key");
    throw new Error("an API key is needed");
  }
  return r;
}

async function errorOf(r) {
  try { const body = await r.json(); return (body.error && body.error.message) || r.statusText; }
  catch (e) { return r.statusText; }
}

// ------------------------------------------------------------------ fleet and requests

function refreshSoon() {
  if (!refreshTimer) refreshTimer = setTimeout(() => { refreshTimer = null; refreshFleet(); }, 100);
}

async function refreshFleet() {
  const r = await api("/v1/fleet");
  if (!r.ok) return;
  const s = await r.json();
  $("host").textContent = s.hostname + (s.http ? " · " + s.http : "");
  fill("executors", s.executors.map((x) => {
    const used = x.memory_total && x.memory_free !== null ? x.memory_total - x.memory_free : 0;
    const fillBar = el("span", {});
    fillBar.style.width = (x.memory_total ? Math.round(100 * used / x.memory_total) : 0) + "%";  // (CSSOM: CSP allows it)
    const bar = el("span", { class: "bar", title: bytes(used) + " of " + bytes(x.memory_total) + " in use" }, fillBar);
    return [x.name, x.vendor, el("span", {}, bar, " " + bytes(x.memory_free) + " free")];
  }));
  // each speculative method's acceptance rate, where it drafted; the draft model's name
  const rate = (d) => d.method + ": " + Math.round(100 * d.accepted / d.drafted) + "% of " + d.drafted;
  const drafts = (m) => [
    ...(m.draft_model ? [m.draft_model] : []),
    ...(m.drafts || []).filter((d) => d.drafted).map(rate),
  ].join(", ");
  fill("loaded", s.loaded_models.map((m) => [
    m.name,
    (m.state || "resident") + (m.unload_in_ms ? " (unloads in " + age(m.unload_in_ms) + ")" : ""),
    m.assigned_executor,
    (m.busy || 0) + "/" + (m.slots || 0) + (m.queued ? " +" + m.queued + " queued" : ""),
    bytes((m.weights_bytes || 0) + (m.kv_bytes || 0)),
    drafts(m),
    m.engine_pid ? "pid " + m.engine_pid : "",
    m.engine_restarts || 0,
    el("button", { type: "button", class: "unload", "data-model": m.name, onclick: () => unload(m.name) }, "Unload"),
  ]), s.loaded_models.map((m) => m.name));
  const reqs = s.requests || [];
  running = reqs.length;
  const now = performance.now();
  const rates = new Map();
  for (const q of reqs) {
    const before = seenTokens.get(q.request_id);
    if (before && now > before[1] && q.tokens >= before[0]) {
      rates.set(q.request_id, (q.tokens - before[0]) / ((now - before[1]) / 1000));
    }
  }
  seenTokens.clear();
  for (const q of reqs) seenTokens.set(q.request_id, [q.tokens, now]);
  fill("active", reqs.map((q) => {
    const pos = positions.get(q.request_id);
    const rate = rates.get(q.request_id);
    const state = q.state + (q.lane === "background" ? " bg" : "") +
      (q.state !== "running" && pos ? " #" + pos : "") + (q.eta_ms ? " ~" + age(q.eta_ms) : "");
    return [short(q.request_id), q.model, q.principal, state,
      q.tokens + (rate !== undefined && q.state === "running" ? " (" + rate.toFixed(1) + "/s)" : ""),
      age(q.age_ms),
      el("button", { type: "button", class: "cancel", "data-id": q.request_id, onclick: () => cancel(q.request_id) }, "Cancel")];
  }), reqs.map((q) => q.request_id));
}

function renderFinished() {
  fill("finished", finished.map((e) => [short(e.request_id), e.model, e.principal,
    e.outcome + (e.finish_reason ? " (" + e.finish_reason + ")" : ""),
    e.usage ? e.usage.prompt_tokens : "", e.usage ? e.usage.cached_tokens : "",
    e.usage ? e.usage.output_tokens : ""]));
}

async function cancel(id) {
  const r = await api("/v1/requests/" + encodeURIComponent(id) + "/cancel", { method: "POST" });
  if (!r.ok) note("cancel " + id + ": " + await errorOf(r));
}

function note(text) {
  $("log").prepend(el("li", {}, new Date().toLocaleTimeString() + " " + text));
  while ($("log").children.length > 200) $("log").lastChild.remove();
}

function describe(e) {
  switch (e.type) {
    case "request": return "request " + e.request_id + " " + e.model + " " + e.state +
      (e.position ? " at " + e.position : "") + (e.outcome ? " " + e.outcome : "");
    case "model_loaded": return "loaded " + e.model + " on " + e.executor;
    case "model_unloaded": return "unloaded " + e.model + " (" + e.why + ")";
    case "model_evicted": return "evicted " + e.model + " for " + e.for_model + " (" + e.reason + ")";
    case "engine_died": return "engine of " + e.model + " died: " + e.cause;
    case "engine_restarted": return "engine of " + e.model + " restarted (" + e.restarts + ")";
    case "room_wait": return e.model + " waited " + e.waited_s + " s for memory: " + e.outcome;
    default: return e.type;
  }
}

function onEvent(e) {
  note(describe(e));
  if (e.type === "request") {
    if (e.position) positions.set(e.request_id, e.position);
    if (e.state === "finished") {
      positions.delete(e.request_id);
      finished.unshift(e);
      finished.length = Math.min(finished.length, 30);
      renderFinished();
      usageSoon();
    }
  }
  if (e.type !== "request") refreshModels();
  refreshSoon();
}

async function listen() {
  for (;;) {
    try {
      const r = await api("/v1/events");
      if (!r.ok) throw new Error(await errorOf(r));
      setStatus("live");
      refreshFleet();
      await blocks(r, "\n\n", (block) => {
        const data = block.split("\n").find((line) => line.startsWith("data: "));
        if (data) onEvent(JSON.parse(data.slice(6)));
      });
    } catch (err) {
      if (!$("key-form").hidden) return;  // (started again once a key is given)
    }
    setStatus("reconnecting…");
    await sleep(2000);
  }
}

// ------------------------------------------------------------------ models

async function refreshModels() {
  const r = await api("/v1/models");
  if (!r.ok) return;
  const models = (await r.json()).data;
  fill("registry", models.map((m) => [m.id + (m.default ? " *" : ""), m.context_length,
    m.loaded ? "on " + m.executor : "",
    m.loaded ? el("button", { type: "button", onclick: () => unload(m.id) }, "Unload")
      : el("button", { type: "button", class: "load", "data-model": m.id, onclick: () => load(m.id) }, "Load")]));
  const select = $("chat-model");
  const chosen = select.value;
  select.replaceChildren(...models.map((m) => el("option", { value: m.id }, m.id)));
  const fallback = models.find((m) => m.default);
  select.value = chosen || (fallback ? fallback.id : (models[0] ? models[0].id : ""));
}

async function load(name) {
  note("loading " + name + "…");
  const r = await api("/v1/models/" + encodeURIComponent(name) + "/load", { method: "POST" });
  if (!r.ok) note("load " + name + ": " + await errorOf(r));
}

async function unload(name) {
  const r = await api("/v1/models/" + encodeURIComponent(name) + "/unload", { method: "POST" });
  if (!r.ok) note("unload " + name + ": " + await errorOf(r));
}

async function pull(event) {
  event.preventDefault();
  const name = $("pull-name").value.trim();
  if (!name) return;
  const bar = $("pull-progress");
  bar.hidden = false;
  $("pull-status").textContent = "pulling " + name + "…";
  const r = await api("/api/pull", { method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: name, stream: true }) });
  if (!r.ok) { $("pull-status").textContent = await errorOf(r); bar.hidden = true; return; }
  await blocks(r, "\n", (line) => {
    if (!line.trim()) return;
    const obj = JSON.parse(line);
    if (obj.error) $("pull-status").textContent = obj.error;
    else $("pull-status").textContent = obj.status || "";
    if (obj.total) { bar.max = obj.total; bar.value = obj.completed || 0; }
  });
  refreshModels();
}

async function blocks(r, sep, each) {
  // Each ``sep``-separated block of a streamed body, as it arrives (SSE: "\n\n";
  // JSON lines: "\n").
  const reader = r.body.getReader();
  const text = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += text.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf(sep)) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + sep.length);
      each(block);
    }
  }
}

// ------------------------------------------------------------------ usage

async function refreshUsage() {
  for (const by of ["key", "model"]) {
    const r = await api("/v1/usage?by=" + by);
    if (!r.ok) continue;
    fill("usage-" + by, (await r.json()).rows.map((row) => [row[by], row.requests, row.prompt_tokens, row.generated_tokens]));
  }
}

async function chart() {
  // Tokens generated each hour of the last day, from the audit log.
  const r = await api("/v1/usage?by=hour");
  if (!r.ok) return;
  const hours = new Map((await r.json()).rows.map((row) => [row.hour, row.generated_tokens]));
  const svg = $("usage-chart");
  const ns = "http://www.w3.org/2000/svg";
  const now = new Date();
  const values = Array.from({ length: 24 }, (_, i) => {
    const t = new Date(now.getTime() - (23 - i) * 3600000);
    const label = t.getFullYear() + "-" + String(t.getMonth() + 1).padStart(2, "0") + "-" +
      String(t.getDate()).padStart(2, "0") + "T" + String(t.getHours()).padStart(2, "0") + ":00";
    return [label, hours.get(label) || 0];
  });
  const top = Math.max(1, ...values.map((v) => v[1]));
  svg.replaceChildren(...values.map(([label, v], i) => {
    const bar = document.createElementNS(ns, "rect");
    const h = Math.round(110 * v / top);
    bar.setAttribute("x", String(i * 25));
    bar.setAttribute("y", String(115 - h));
    bar.setAttribute("width", "20");
    bar.setAttribute("height", String(h));
    const title = document.createElementNS(ns, "title");
    title.textContent = label + ": " + v + " tokens";
    bar.append(title);
    return bar;
  }));
}

// ------------------------------------------------------------------ start

let usageTimer = null;
function usageSoon() {
  if (!usageTimer) usageTimer = setTimeout(() => { usageTimer = null; refreshUsage(); chart(); }, 500);
}

function start() {
  refreshModels().catch(() => {});
  startChat().catch(() => {});
  refreshUsage().catch(() => {});
  chart().catch(() => {});
  listen();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    key = $("key").value.trim();
    sessionStorage.setItem("everycycle-key", key);
    $("key-form").hidden = true;
    start();
  });
  $("pull-form").addEventListener("submit", pull);
  setInterval(() => { if (running) refreshFleet(); }, 1000);
  start();
});
