// The console's chat: the loop `everycycle chat` runs. The model is offered the daemon's
// MCP tools (GET /v1/mcp/tools: only for the daemon's own user); each call it makes is
// put to the user (allow once, always in this conversation, deny) before the daemon
// runs it, and its result (or the denial, or the tool's error) goes back to the model.
// Answers are rendered as Markdown, safely (markdown.js). Each conversation is saved
// after every turn, as `chat` saves its own, and past ones reopen.
"use strict";

const MAX_ROUNDS = 8;  // tool rounds in one turn before the model must answer
const DENIED = "The user did not allow this tool call.";  // (as `chat` says it)
const history = [];    // the conversation, as OpenAI's chat messages
const allowed = new Set();
let tools = [];
let current = null;
let pendingConsent = null;  // the call waiting for a click: Stop denies it
let conversationId = null;

document.addEventListener("DOMContentLoaded", () => {
  $("chat-form").addEventListener("submit", send);
  $("chat-stop").addEventListener("click", stop);
  $("chat-new").addEventListener("click", newConversation);
  $("chat-past").addEventListener("change", () => reopen($("chat-past").value));
});

async function startChat() {
  await Promise.all([loadTools(), refreshPast()]);
}

async function loadTools() {
  const r = await api("/v1/mcp/tools");  // (403 for a key's holder: no tools)
  const listed = r.ok ? await r.json() : { tools: [], problems: [] };
  for (const problem of listed.problems) note(problem);
  tools = listed.tools;
  const servers = [...new Set(tools.map((t) => t.server))];
  $("chat-tools").textContent = tools.length
    ? "tools: " + tools.length + " from " + servers.join(", ") + " (each call asks you first)" : "";
}

function turn(kind, text) {
  const t = el("div", { class: "turn " + kind }, text);
  $("transcript").append(t);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return t;
}

function answerTurn(text) {
  const t = turn("assistant", "");
  const body = el("div", { class: "md" });
  t.append(body);
  renderMarkdown(body, text);
  return [t, body];
}

function imageOf(file) {
  return new Promise((done, fail) => {
    const reader = new FileReader();
    reader.onload = () => done(reader.result);
    reader.onerror = () => fail(reader.error);
    reader.readAsDataURL(file);
  });
}

async function send(event) {
  event.preventDefault();
  const text = $("chat-input").value;
  const file = $("chat-image").files[0];
  if (!text.trim() && !file) return;
  $("chat-input").value = "";
  $("chat-image").value = "";
  const content = file ? [{ type: "text", text }, { type: "image_url", image_url: { url: await imageOf(file) } }] : text;
  history.push({ role: "user", content });
  turn("user", text + (file ? " [" + file.name + "]" : ""));
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  try {
    for (let round = 0; round <= MAX_ROUNDS; round++) {
      const calls = await answer(round === MAX_ROUNDS, round === 0);
      if (!calls) break;
      for (const call of calls) history.push(await runTool(call));
    }
    await saveConversation();
  } finally {
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
    current = null;
  }
}

// One answer streamed into the transcript; the tool calls it made (null: none).
async function answer(last, first) {
  const [shown, body] = answerTurn("");
  let thoughts = null;
  const sent = performance.now();
  let firstToken = 0;
  let said = "";
  const calls = [];
  let drawing = null;  // (redrawn at most every 50 ms: a long answer stays cheap)
  const draw = () => { drawing = null; renderMarkdown(body, said); };
  current = { id: null };
  const request = { model: $("chat-model").value, messages: history, stream: true,
    stream_options: { include_usage: true } };
  if (tools.length) {
    request.tools = tools.map((t) => ({ type: "function",
      function: { name: t.name, description: t.description, parameters: t.parameters } }));
    if (last) request.tool_choice = "none";
  }
  const fail = (message) => {
    clearTimeout(drawing);
    shown.className = "turn error";
    body.textContent = said + " (" + message + ")";
    if (first && !said) history.pop();  // (nothing came back: the question is not kept)
    return null;
  };
  try {
    const r = await api("/v1/chat/completions", { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify(request) });
    current.id = r.headers.get("x-request-id");
    $("chat-figures").textContent = "request " + current.id;
    if (!r.ok) return fail(await errorOf(r));
    let usage = null;
    let error = null;
    await blocks(r, "\n\n", (block) => {
      if (block.startsWith(": queue_position")) {
        $("chat-figures").textContent = "request " + current.id + " · queued: " + block.slice(2);
        return;
      }
      if (!block.startsWith("data: ") || block === "data: [DONE]") return;
      const obj = JSON.parse(block.slice(6));
      if (obj.error) { error = obj.error.message; return; }
      if (obj.usage) usage = obj.usage;
      const delta = (obj.choices && obj.choices[0] && obj.choices[0].delta) || {};
      if (delta.reasoning_content) {
        if (!thoughts) { thoughts = el("details", { class: "thinking" }, el("summary", {}, "thinking")); shown.prepend(thoughts); }
        thoughts.append(delta.reasoning_content);
      }
      for (const part of delta.tool_calls || []) {
        const call = calls[part.index] || (calls[part.index] = { id: "", name: "", arguments: "" });
        call.id = part.id || call.id;
        if (part.function) {
          call.name += part.function.name || "";
          call.arguments += part.function.arguments || "";
        }
      }
      if (delta.content) {
        firstToken = firstToken || performance.now();
        said += delta.content;
        drawing = drawing || setTimeout(draw, 50);
      }
    });
    clearTimeout(drawing);
    draw();
    if (error) return fail(error);
    if (usage) figures(usage, sent, firstToken);
  } catch (err) {
    return fail(err.message);
  }
  if (!said) shown.remove();
  if (calls.length) {
    history.push({ role: "assistant", content: said || null, tool_calls: calls.map((c) =>
      ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } })) });
    return calls;
  }
  if (said) history.push({ role: "assistant", content: said });
  return null;
}

function figures(usage, sent, first) {
  const secs = first ? (performance.now() - first) / 1000 : 0;
  $("chat-figures").textContent = "request " + current.id + " · prompt " + usage.prompt_tokens +
    " tokens (" + ((usage.prompt_tokens_details || {}).cached_tokens || 0) + " cached), generated " +
    usage.completion_tokens + "; first token " + Math.round((first || performance.now()) - sent) + " ms" +
    (secs > 0 ? ", " + (usage.completion_tokens / secs).toFixed(1) + " tokens/s" : "");
}

async function stop() {
  if (pendingConsent) pendingConsent("deny");
  else if (current && current.id) await cancel(current.id);
}

// ------------------------------------------------------------------ tools

function toolBox(name, args) {
  const box = el("div", { class: "turn tool" }, el("div", { class: "call" }, "⚒ " + name + " " + args));
  $("transcript").append(box);
  return box;
}

function showResult(box, text, isError) {
  const line = (text.split("\n")[0] || "").slice(0, 120);
  box.append(el("details", { class: isError ? "result error" : "result" },
    el("summary", {}, (isError ? "✗ " : "→ ") + line), el("pre", {}, text)));
}

async function runTool(call) {
  const box = toolBox(call.name, call.arguments);
  let text;
  let isError = true;
  if (!tools.some((t) => t.name === call.name)) {
    text = "There is no tool named '" + call.name + "'.";
  } else if (!allowed.has(call.name) && !(await consent(box, call.name))) {
    text = DENIED;
  } else {
    let args = {};
    try { args = JSON.parse(call.arguments || "{}"); } catch (e) { /* the daemon says why */ }
    const r = await api("/v1/mcp/tools/" + encodeURIComponent(call.name) + "/call", { method: "POST",
      headers: { "content-type": "application/json" }, body: JSON.stringify({ arguments: args }) });
    if (r.ok) { const got = await r.json(); text = got.content; isError = got.is_error; }
    else text = await errorOf(r);
  }
  showResult(box, text, isError);
  return { role: "tool", tool_call_id: call.id, content: text || "(no output)" };
}

function consent(box, name) {
  return new Promise((done) => {
    const ask = el("div", { class: "consent" }, "allow " + name + "? ");
    const choose = (how) => {
      pendingConsent = null;
      ask.remove();
      if (how === "always") allowed.add(name);
      if (how === "deny") box.append(el("div", { class: "muted" }, "(denied)"));
      done(how !== "deny");
    };
    ask.append(el("button", { type: "button", class: "allow", onclick: () => choose("once") }, "Allow once"),
      el("button", { type: "button", class: "always", onclick: () => choose("always") }, "Always in this chat"),
      el("button", { type: "button", class: "deny", onclick: () => choose("deny") }, "Deny"));
    box.append(ask);
    pendingConsent = choose;
  });
}

// ------------------------------------------------------------------ conversations

function savedMessage(m) {
  const parts = (content) => content.map((p) => {
    if (p.type === "text") return { type: "text", text: p.text };
    const m = p.image_url.url.match(/^data:([^;,]+);base64,(.*)$/);
    return { type: "image", data: m ? m[2] : "", mime: m ? m[1] : undefined };
  });
  const out = { role: m.role, content: typeof m.content === "string" ? m.content : (m.content ? parts(m.content) : "") };
  if (m.tool_calls) out.tool_calls = m.tool_calls.map((c) => ({ id: c.id, name: c.function.name, arguments: c.function.arguments }));
  if (m.tool_call_id) out.tool_call_id = m.tool_call_id;
  return out;
}

function chatMessage(m) {
  const content = typeof m.content === "string" ? m.content : m.content.map((p) => p.type === "text"
    ? { type: "text", text: p.text } : { type: "image_url", image_url: { url: "data:" + (p.mime || "image/png") + ";base64," + p.data } });
  const out = { role: m.role, content };
  if (m.tool_calls) out.tool_calls = m.tool_calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
  if (m.tool_call_id) out.tool_call_id = m.tool_call_id;
  return out;
}

async function saveConversation() {
  if (!history.length) return;
  const lead = history[0].role === "system" ? history[0].content : null;
  const doc = { model: $("chat-model").value, system: lead,
    messages: history.slice(lead === null ? 0 : 1).map(savedMessage) };
  const opts = { method: conversationId ? "PUT" : "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify(doc) };
  const r = await api("/v1/conversations" + (conversationId ? "/" + encodeURIComponent(conversationId) : ""), opts);
  if (!r.ok) return;  // (a key's holder: the conversations are the daemon's user's)
  conversationId = (await r.json()).id;
  await refreshPast();
}

async function refreshPast() {
  const r = await api("/v1/conversations");
  const past = r.ok ? (await r.json()).conversations : [];
  const select = $("chat-past");
  select.replaceChildren(el("option", { value: "" }, "new conversation"), ...past.map((c) =>
    el("option", { value: c.id }, (c.title || "(no words)") + " · " + c.model + " · " + new Date(c.updated * 1000).toLocaleString())));
  select.value = conversationId || "";
}

function newConversation() {
  history.length = 0;
  allowed.clear();
  conversationId = null;
  $("transcript").replaceChildren();
  $("chat-past").value = "";
}

async function reopen(id) {
  if (!id) return newConversation();
  const r = await api("/v1/conversations/" + encodeURIComponent(id));
  if (!r.ok) { note("conversation " + id + ": " + await errorOf(r)); return; }
  const saved = await r.json();
  newConversation();
  conversationId = saved.id;
  $("chat-past").value = saved.id;
  if ([...$("chat-model").options].some((o) => o.value === saved.model)) $("chat-model").value = saved.model;
  if (saved.system) history.push({ role: "system", content: saved.system });
  const boxes = new Map();
  for (const m of saved.messages) {
    history.push(chatMessage(m));
    const text = typeof m.content === "string" ? m.content : m.content.filter((p) => p.type === "text").map((p) => p.text).join("");
    if (m.role === "user") turn("user", text);
    else if (m.role === "assistant" && m.tool_calls) {
      if (text) answerTurn(text);
      for (const c of m.tool_calls) boxes.set(c.id, toolBox(c.name, c.arguments));
    } else if (m.role === "assistant") answerTurn(text);
    else if (m.role === "tool" && boxes.has(m.tool_call_id)) showResult(boxes.get(m.tool_call_id), text, false);
  }
}
