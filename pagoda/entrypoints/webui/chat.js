// pagoda's chat page: plain JavaScript, no dependencies, nothing fetched but this
// server's own API (GET /v1/models, POST /v1/chat/completions streamed).
//
//   markdown     renderMarkdown(text) -> HTML: every character of the text escaped,
//                only the renderer's own tags let through; code highlighted
//   storage      conversations, settings and the API key in localStorage
//   models       the model and LoRA adapter pickers, from /v1/models
//   answers      one streamed request at a time: SSE parsed, Stop aborts it
//   views        the conversation list, the messages, the composer
"use strict";

// ---- markdown ---------------------------------------------------------------------

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const LINK = /\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;
const BARE_URL = /\bhttps?:\/\/[^\s<>"'`]*[^\s<>"'`.,;:!?)\]]/g;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s{0,3}>\s?/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)+\|?\s*$|^\s*\|\s*:?-+:?\s*\|\s*$/;

function link(url, label) {
  return `<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${label}</a>`;
}

// One line of text -> HTML. Code spans and links are rendered first and held aside
// (as \0N\0) so that the emphasis rules, which run on escaped text, never reach into
// them.
function renderInline(text) {
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = String(text).replace(/\u0000/g, "");
  s = s.replace(/`([^`\n]+)`/g, (_, code) => hold(`<code>${escapeHtml(code)}</code>`));
  s = s.replace(LINK, (_, label, url) => hold(link(url, emphasis(escapeHtml(label)))));
  s = s.replace(BARE_URL, (url) => hold(link(url, escapeHtml(url))));
  s = emphasis(escapeHtml(s));
  const restore = (t) => t.replace(/\u0000(\d+)\u0000/g, (_, i) => restore(held[Number(i)]));
  return restore(s);
}

function emphasis(escaped) {
  return escaped
    .replace(/\*\*(?=\S)([^\n]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([^\n]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^\w*])\*(?=[^\s*])([^*\n]*?[^\s*]|[^\s*])\*(?![\w*])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_]|[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([^\n]*?\S)~~/g, "<del>$1</del>");
}

function indentOf(line) {
  return line.match(/^\s*/)[0].length;
}

function startsBlock(lines, i) {
  const line = lines[i];
  return (
    FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    LIST_ITEM.test(line) || isTableStart(lines, i)
  );
}

function isTableStart(lines, i) {
  return lines[i].includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]);
}

function tableCells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

// Markdown -> HTML: headings, paragraphs (line breaks kept), lists (nested by
// indentation), block quotes, rules, tables, fenced code. A fence still open at the
// end (an answer still streaming) runs to the end.
function renderMarkdown(text) {
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = line.match(FENCE))) {
      const code = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(m[1]); i++) code.push(lines[i]);
      i++;
      out.push(codeBlock(code.join("\n"), m[2]));
    } else if ((m = line.match(HEADING))) {
      const level = m[1].length;
      out.push(`<h${level}>${renderInline(m[2])}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) {
        quoted.push(lines[i].replace(QUOTE, ""));
      }
      out.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
    } else if (isTableStart(lines, i)) {
      i = renderTable(lines, i, out);
    } else if (LIST_ITEM.test(line)) {
      i = renderList(lines, i, out);
    } else {
      const paragraph = [line];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines, i); i++) {
        paragraph.push(lines[i]);
      }
      out.push(`<p>${paragraph.map((l) => renderInline(l.trim())).join("<br>")}</p>`);
    }
  }
  return out.join("\n");
}

// A list from lines[start]; returns the index after it. An item's own lines (more
// indented, or after a blank line inside the list) are rendered as markdown of their own.
function renderList(lines, start, out) {
  const first = lines[start].match(LIST_ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  let i = start;
  for (; i < lines.length; i++) {
    const line = lines[i];
    const m = line.match(LIST_ITEM);
    if (m && m[1].length <= indent) {
      if (m[1].length < indent || /\d/.test(m[2]) !== ordered) break;
      items.push({ lines: [m[3]], contentIndent: indent + m[2].length + 1 });
    } else if (!line.trim()) {
      const next = lines[i + 1];
      if (next === undefined || !next.trim()) break;
      const more = LIST_ITEM.test(next) ? indentOf(next) >= indent : indentOf(next) > indent;
      if (!more) break;
      items.at(-1).lines.push("");
    } else if (indentOf(line) > indent || !startsBlock(lines, i)) {
      const item = items.at(-1);
      item.lines.push(line.slice(Math.min(indentOf(line), item.contentIndent)));
    } else {
      break;
    }
  }
  const tag = ordered ? "ol" : "ul";
  const number = parseInt(first[2], 10);
  const startAttr = ordered && number !== 1 ? ` start="${number}"` : "";
  const html = items.map((item) =>
    item.lines.length === 1 ? renderInline(item.lines[0]) : renderMarkdown(item.lines.join("\n")),
  );
  out.push(`<${tag}${startAttr}>${html.map((h) => `<li>${h}</li>`).join("")}</${tag}>`);
  return i;
}

function renderTable(lines, start, out) {
  const aligns = tableCells(lines[start + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : "",
  );
  const row = (line, tag) =>
    "<tr>" +
    tableCells(line)
      .map((cell, j) => {
        const align = aligns[j] ? ` class="align-${aligns[j]}"` : "";
        return `<${tag}${align}>${renderInline(cell)}</${tag}>`;
      })
      .join("") +
    "</tr>";
  let i = start + 2;
  const body = [];
  for (; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
    body.push(row(lines[i], "td"));
  }
  const head = `<thead>${row(lines[start], "th")}</thead>`;
  out.push(`<table>${head}<tbody>${body.join("")}</tbody></table>`);
  return i;
}

function codeBlock(code, lang) {
  const label = `<span class="lang">${escapeHtml(lang || "code")}</span>`;
  const copy = '<button type="button" class="copy">Copy</button>';
  const pre = `<pre><code>${highlight(code, lang)}</code></pre>`;
  return `<div class="code"><div class="code-bar">${label}${copy}</div>${pre}</div>`;
}

// ---- syntax highlighting: one pass of one regular expression per comment style ----

const KEYWORDS = new Set(
  ("and as assert async await break case catch class const continue def default defer del " +
    "do elif else enum except export extends finally fn for from func function go if impl " +
    "import in interface is lambda let loop match mod module mut new nonlocal not of or " +
    "package pass pub raise return static struct super switch this throw throws trait try " +
    "type typeof use var void where while with yield int float double char bool boolean " +
    "string str long short unsigned auto self").split(" "),
);
const LITERALS = new Set("true false True False None null nil undefined NaN".split(" "));
const HASH_COMMENTS = new Set(
  ("python py bash sh shell zsh console ruby rb yaml yml toml perl r makefile dockerfile " +
    "ini conf powershell ps1 julia nim elixir").split(" "),
);
const DASH_COMMENTS = new Set("sql lua haskell hs ada".split(" "));
const STRINGS =
  String.raw`"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|` +
  "`(?:[^`\\\\]|\\\\.)*`";
const NUMBER = String.raw`\b(?:0[xX][\da-fA-F]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b`;
const patterns = new Map(); // comment style -> its token pattern

function tokenPattern(lang) {
  let style = lang ? "c" : "any";
  if (HASH_COMMENTS.has(lang)) style = "hash";
  if (DASH_COMMENTS.has(lang)) style = "dash";
  if (!patterns.has(style)) {
    const comment = {
      hash: String.raw`#[^\n]*`,
      dash: String.raw`--[^\n]*`,
      c: String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)`,
      any: String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)|#[^\n]*`,
    }[style];
    const source = `(${comment})|(${STRINGS})|(${NUMBER})|([A-Za-z_$][\\w$]*)(\\s*\\()?`;
    patterns.set(style, new RegExp(source, "g"));
  }
  return patterns.get(style);
}

// Code -> escaped HTML with <span class="tok-*"> around comments, strings, numbers,
// keywords, literals and called names.
function highlight(code, lang) {
  let html = "";
  let last = 0;
  for (const m of code.matchAll(tokenPattern((lang || "").toLowerCase()))) {
    const [text, comment, string, number, word, call] = m;
    html += escapeHtml(code.slice(last, m.index));
    last = m.index + text.length;
    const kind = comment ? "c" : string ? "s" : number ? "n" : KEYWORDS.has(word) ? "k"
      : LITERALS.has(word) ? "l" : call ? "f" : "";
    const token = escapeHtml(word ?? text);
    html += (kind ? `<span class="tok-${kind}">${token}</span>` : token) + escapeHtml(call ?? "");
  }
  return html + escapeHtml(code.slice(last));
}

// ---- storage ------------------------------------------------------------------------

const STORE = {
  conversations: "pagoda.chat.conversations",
  current: "pagoda.chat.current",
  settings: "pagoda.chat.settings",
  apiKey: "pagoda.apiKey",
};
const NEW_TITLE = "New chat";

function loadJSON(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

const state = {
  conversations: [].concat(loadJSON(STORE.conversations, [])),
  currentId: localStorage.getItem(STORE.current),
  models: [], // the cards of GET /v1/models
  controller: null, // the AbortController of the answer streaming now
  streaming: null, // the message it streams into
  attachments: [], // data: URLs to go with the next message
};
const settings = {
  system: "", temperature: "", top_p: "", max_tokens: "", model: "", adapter: "",
  ...loadJSON(STORE.settings, {}),
};

function saveSettings() {
  localStorage.setItem(STORE.settings, JSON.stringify(settings));
}

function saveConversations() {
  localStorage.setItem(STORE.current, state.currentId ?? "");
  try {
    localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
  } catch {
    // The browser's quota (a few MB) is full, most likely of images: keep the text.
    const text = JSON.stringify(state.conversations, (k, v) => (k === "images" ? undefined : v));
    try {
      localStorage.setItem(STORE.conversations, text);
      showNotice("Browser storage is full: images in conversations are not kept.");
    } catch {
      showNotice("Browser storage is full: conversations are not saved.");
    }
  }
}

function apiKey() {
  return localStorage.getItem(STORE.apiKey) || "";
}

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  return headers;
}

function currentConversation() {
  return state.conversations.find((c) => c.id === state.currentId) ?? null;
}

// ---- models -----------------------------------------------------------------------

async function loadModels() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: apiHeaders() });
  } catch (e) {
    showNotice(`Could not reach the server: ${e.message}`);
    return;
  }
  if (response.status === 401) {
    showKeyForm(apiKey() ? "The server refused this API key." : "This server needs an API key.");
    return;
  }
  if (!response.ok) {
    showNotice(`Could not list the models: ${await errorMessage(response)}`);
    return;
  }
  state.models = (await response.json()).data ?? [];
  $("key-form").hidden = true;
  showNotice("");
  fillModelPickers();
}

function baseModels() {
  return state.models.filter((c) => !c.parent && (!c.tasks || c.tasks.includes("generate")));
}

function statusLabel(card) {
  return card.status?.value ? ` (${card.status.value})` : "";
}

function fillModelPickers() {
  const bases = baseModels();
  const picker = $("model");
  picker.textContent = "";
  for (const card of bases) picker.add(new Option(card.id + statusLabel(card), card.id));
  if (!bases.length) {
    picker.add(new Option("(no chat models)", ""));
    const keyHint = apiKey() ? "" : " If it needs an API key, set one in Settings.";
    showNotice(`The server lists no model that generates text.${keyHint}`);
  }
  if (bases.some((c) => c.id === settings.model)) picker.value = settings.model;
  fillAdapterPicker();
}

function fillAdapterPicker() {
  const base = $("model").value;
  const bases = baseModels();
  // An adapter's parent is its base model's first name: with one base model, all are its.
  const adapters = state.models.filter(
    (c) => c.parent && (c.parent === base || bases.length === 1),
  );
  const picker = $("adapter");
  picker.textContent = "";
  picker.add(new Option("no adapter", ""));
  for (const card of adapters) picker.add(new Option(card.id + statusLabel(card), card.id));
  picker.hidden = !adapters.length;
  picker.value = adapters.some((c) => c.id === settings.adapter) ? settings.adapter : "";
  updateAttachButton();
}

function takesImages() {
  const card = state.models.find((c) => c.id === $("model").value);
  return Boolean(card?.input_modalities?.includes("image"));
}

function requestModel() {
  return $("adapter").value || $("model").value;
}

// ---- answers ------------------------------------------------------------------------

function apiMessages(history) {
  const messages = [];
  if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
  for (const m of history) {
    if (m.role === "user") {
      const images = (m.images ?? []).map((url) => ({ type: "image_url", image_url: { url } }));
      const content = images.length ? [{ type: "text", text: m.content }, ...images] : m.content;
      messages.push({ role: "user", content });
    } else if (m.content) {
      messages.push({ role: "assistant", content: m.content }); // failed answers are left out
    }
  }
  return messages;
}

function requestBody(history) {
  const body = {
    messages: apiMessages(history),
    stream: true,
    stream_options: { include_usage: true },
  };
  if (requestModel()) body.model = requestModel();
  for (const name of ["temperature", "top_p", "max_tokens"]) {
    if (settings[name] !== "") body[name] = Number(settings[name]);
  }
  return body;
}

// Stream an answer to the conversation's messages so far into a new assistant message.
async function answer(conversation) {
  const reply = { role: "assistant", content: "", reasoning: "", toolCalls: [] };
  reply.model = requestModel();
  const history = conversation.messages.slice();
  conversation.messages.push(reply);
  conversation.updatedAt = Date.now();
  const controller = new AbortController();
  state.controller = controller;
  state.streaming = reply;
  saveConversations();
  renderAll();
  const started = performance.now();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: apiHeaders(),
      body: JSON.stringify(requestBody(history)),
      signal: controller.signal,
    });
    if (!response.ok) {
      reply.error = await describeFailure(response);
    } else {
      await readEvents(response, (event) => {
        applyChunk(reply, event);
        scheduleUpdate(reply);
      });
    }
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else reply.error = `The request failed: ${e.message}`;
  } finally {
    reply.elapsedMs = performance.now() - started;
    state.controller = null;
    state.streaming = null;
    conversation.updatedAt = Date.now();
    saveConversations();
    renderAll();
  }
}

// Server-sent events: calls onEvent with each `data:` JSON until the body ends.
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r/g, "");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer
        .slice(0, end)
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      buffer = buffer.slice(end + 2);
      if (data && data !== "[DONE]") onEvent(JSON.parse(data));
    }
  }
}

function applyChunk(reply, chunk) {
  if (chunk.error) {
    reply.error = `The answer failed: ${chunk.error.message ?? JSON.stringify(chunk.error)}`;
    return;
  }
  if (chunk.usage) reply.usage = chunk.usage;
  const choice = chunk.choices?.[0];
  if (!choice) return;
  const delta = choice.delta ?? {};
  if (delta.content) reply.content += delta.content;
  // The server may send the reasoning under both names; take one.
  const thought = delta.reasoning_content ?? delta.reasoning;
  if (thought) reply.reasoning += thought;
  for (const piece of delta.tool_calls ?? []) {
    const index = piece.index ?? reply.toolCalls.length;
    const call = (reply.toolCalls[index] ??= { name: "", arguments: "" });
    if (piece.function?.name && !call.name) call.name = piece.function.name;
    if (piece.function?.arguments) call.arguments += piece.function.arguments;
  }
  if (choice.finish_reason) reply.finishReason = choice.finish_reason;
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return body.error?.message ?? body.detail ?? text;
  } catch {
    return text || response.statusText;
  }
}

async function describeFailure(response) {
  const message = await errorMessage(response);
  const status = response.status;
  if (status === 401) {
    showKeyForm("The server wants an API key for this.");
    return `${message} Set the API key, then press Regenerate.`;
  }
  if (status === 429 || status === 503) {
    const wait = response.headers.get("Retry-After");
    const when = wait ? `in ${wait} s` : "in a moment";
    return `The server is busy (${status}): ${message}\nTry again ${when} with Regenerate.`;
  }
  if (status === 400) return `The server refused the request: ${message}`;
  return `Error ${status}: ${message}`;
}

// ---- views ---------------------------------------------------------------------------

const $ = (id) => document.getElementById(id);
const views = new WeakMap(); // a message -> its element, while shown
let updatePending = false;

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function button(text, className, title, onClick) {
  const b = element("button", className, text);
  b.type = "button";
  if (title) b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

function showNotice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function showKeyForm(message) {
  $("key-message").textContent = message;
  $("key-input").value = apiKey();
  $("key-form").hidden = false;
  $("key-input").focus();
}

function renderAll() {
  renderSidebar();
  renderConversation();
  const busy = state.controller !== null;
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  $("export").disabled = !currentConversation();
}

function renderSidebar() {
  const list = $("conversations");
  list.textContent = "";
  const newestFirst = [...state.conversations].sort((a, b) => b.updatedAt - a.updatedAt);
  for (const conversation of newestFirst) {
    const item = element("li", conversation.id === state.currentId ? "current" : "");
    item.dataset.id = conversation.id;
    const open = button(conversation.title, "open", conversation.title, () => {
      state.currentId = conversation.id;
      document.body.classList.remove("sidebar-open");
      saveConversations();
      renderAll();
    });
    const rename = button("\u270e", "rename", "Rename", () => startRename(item, conversation));
    const remove = button("\u2715", "delete", "Delete", () => deleteConversation(conversation));
    item.append(open, rename, remove);
    list.append(item);
  }
}

function startRename(item, conversation) {
  const input = element("input");
  input.value = conversation.title;
  item.textContent = "";
  item.append(input);
  input.focus();
  input.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep && input.value.trim()) conversation.title = input.value.trim();
    saveConversations();
    renderSidebar();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
}

function deleteConversation(conversation) {
  if (!confirm(`Delete "${conversation.title}"?`)) return;
  if (state.controller && conversation.messages.includes(state.streaming)) state.controller.abort();
  state.conversations = state.conversations.filter((c) => c !== conversation);
  if (state.currentId === conversation.id) state.currentId = null;
  saveConversations();
  renderAll();
}

function exportConversation() {
  const conversation = currentConversation();
  if (!conversation) return;
  const data = { ...conversation, system: settings.system, exportedAt: new Date().toISOString() };
  const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
  const a = element("a");
  a.href = URL.createObjectURL(blob);
  a.download = `${conversation.title.replace(/[^\w .-]+/g, "_").slice(0, 60) || "chat"}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function renderConversation() {
  const list = $("messages");
  list.textContent = "";
  const conversation = currentConversation();
  if (!conversation || !conversation.messages.length) {
    const welcome = element("div", "welcome");
    welcome.append(element("h2", "", "What can I help with?"));
    const model = requestModel();
    welcome.append(element("p", "", model ? `You are talking to ${model}.` : ""));
    list.append(welcome);
    return;
  }
  const lastAnswer = conversation.messages.findLastIndex((m) => m.role === "assistant");
  conversation.messages.forEach((message, index) => {
    list.append(messageView(conversation, message, index, index === lastAnswer));
  });
  list.scrollTop = list.scrollHeight;
}

function messageView(conversation, message, index, isLastAnswer) {
  const view = element("article", `message ${message.role}`);
  view.innerHTML =
    '<div class="who"></div><details class="reasoning" hidden><summary></summary>' +
    '<div class="body reasoning-body"></div></details><div class="tools"></div>' +
    '<div class="body"></div><div class="images"></div><div class="error" hidden></div>' +
    '<div class="meta"></div><div class="actions"></div>';
  views.set(message, view);
  fillMessage(view, message);
  const actions = view.querySelector(".actions");
  if (state.controller) return view; // no changes while an answer streams
  if (message.role === "user") {
    const edit = () => startEdit(view, conversation, index);
    actions.append(button("Edit", "edit-message", "Edit and send again", edit));
  } else {
    const copy = () => copyText(message.content);
    actions.append(button("Copy", "copy-message", "Copy the answer's markdown", copy));
    if (isLastAnswer) {
      const again = () => regenerate(conversation);
      actions.append(button("Regenerate", "regenerate", "Answer again", again));
    }
  }
  return view;
}

function fillMessage(view, message) {
  const body = view.querySelector(":scope > .body");
  const who = message.role === "user" ? "You" : message.model || "assistant";
  view.querySelector(".who").textContent = who;
  if (message.role === "user") {
    body.textContent = message.content;
    const images = view.querySelector(".images");
    images.textContent = "";
    for (const url of message.images ?? []) {
      const img = element("img");
      img.src = url;
      img.alt = "attached image";
      images.append(img);
    }
    return;
  }
  const streaming = message === state.streaming;
  body.innerHTML = renderMarkdown(message.content);
  body.classList.toggle("pending", streaming && !message.content);
  const reasoning = view.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  const thinking = streaming && !message.content;
  reasoning.querySelector("summary").textContent = thinking ? "Thinking\u2026" : "Reasoning";
  reasoning.querySelector(".reasoning-body").innerHTML = renderMarkdown(message.reasoning);
  fillToolCalls(view.querySelector(".tools"), (message.toolCalls ?? []).filter(Boolean));
  const error = view.querySelector(".error");
  error.textContent = message.error ?? "";
  error.hidden = !message.error;
  view.querySelector(".meta").textContent = streaming ? "" : answerFacts(message);
}

// One folded block per call, kept across updates so an opened one stays open.
function fillToolCalls(box, calls) {
  while (box.children.length < calls.length) {
    const details = element("details", "tool-call");
    details.append(element("summary"), element("pre"));
    box.append(details);
  }
  calls.forEach((call, i) => {
    const [summary, pre] = box.children[i].children;
    summary.textContent = `Tool call: ${call.name}`;
    let args = call.arguments;
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {} // not (yet) whole JSON: shown as it came
    pre.textContent = args;
  });
}

function answerFacts(message) {
  const facts = [];
  const tokens = message.usage?.completion_tokens;
  if (tokens) {
    facts.push(`${tokens} tokens`);
    const seconds = message.elapsedMs / 1000;
    if (seconds > 0) facts.push(`${(tokens / seconds).toFixed(1)} tokens/s`);
  }
  if (message.stopped) facts.push("stopped");
  else if (message.finishReason === "length") facts.push("cut off at the token limit");
  return facts.join(" \u00b7 ");
}

function scheduleUpdate(message) {
  if (updatePending) return;
  updatePending = true;
  requestAnimationFrame(() => {
    updatePending = false;
    const view = views.get(message);
    if (!view || !view.isConnected) return;
    const list = $("messages");
    const atEnd = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
    fillMessage(view, message);
    if (atEnd) list.scrollTop = list.scrollHeight;
  });
}

function startEdit(view, conversation, index) {
  const message = conversation.messages[index];
  const body = view.querySelector(":scope > .body");
  view.querySelector(":scope > .actions").textContent = "";
  const editor = element("div", "edit");
  const input = element("textarea");
  input.value = message.content;
  const save = button("Send", "primary", "Send the edited message", () => {
    message.content = input.value;
    conversation.messages.splice(index + 1); // what followed answered the old text
    answer(conversation);
  });
  const cancel = button("Cancel", "", "", () => renderConversation());
  const row = element("div", "actions");
  row.append(save, cancel);
  editor.append(input, row);
  body.replaceWith(editor);
  input.focus();
}

function regenerate(conversation) {
  const lastUser = conversation.messages.findLastIndex((m) => m.role === "user");
  conversation.messages.splice(lastUser + 1);
  answer(conversation);
}

function send() {
  const text = $("prompt").value.trim();
  if (state.controller || (!text && !state.attachments.length)) return;
  let conversation = currentConversation();
  if (!conversation) {
    const now = Date.now();
    const id = `c${now}${Math.random().toString(36).slice(2, 6)}`;
    conversation = { id, title: NEW_TITLE, createdAt: now, updatedAt: now, messages: [] };
    state.conversations.push(conversation);
    state.currentId = conversation.id;
  }
  if (conversation.title === NEW_TITLE && text) conversation.title = text.slice(0, 48);
  conversation.messages.push({ role: "user", content: text, images: state.attachments.splice(0) });
  $("prompt").value = "";
  fitPrompt();
  renderAttachments();
  answer(conversation);
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // Not a secure context (plain http on another host): the old way.
    const area = element("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
}

// ---- images -------------------------------------------------------------------------

const MAX_IMAGE_SIDE = 1024; // larger images are scaled down: smaller requests and storage

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function imageDataUrl(file) {
  const url = await readDataUrl(file);
  const img = new Image();
  img.src = url;
  await img.decode();
  const scale = MAX_IMAGE_SIDE / Math.max(img.naturalWidth, img.naturalHeight);
  if (scale >= 1) return url;
  const canvas = element("canvas");
  canvas.width = Math.round(img.naturalWidth * scale);
  canvas.height = Math.round(img.naturalHeight * scale);
  canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
  return canvas.toDataURL("image/jpeg", 0.9);
}

async function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    try {
      state.attachments.push(await imageDataUrl(file));
    } catch {
      showNotice(`Could not read ${file.name} as an image.`);
    }
  }
  renderAttachments();
}

function renderAttachments() {
  const box = $("attachments");
  box.textContent = "";
  state.attachments.forEach((url, i) => {
    const thumb = element("div", "thumb");
    const img = element("img");
    img.src = url;
    img.alt = "image to send";
    thumb.append(img, button("\u2715", "", "Remove", () => {
      state.attachments.splice(i, 1);
      renderAttachments();
    }));
    box.append(thumb);
  });
}

function updateAttachButton() {
  const show = takesImages();
  $("attach").hidden = !show;
  if (!show && state.attachments.length) {
    state.attachments = [];
    renderAttachments();
  }
}

// ---- wiring ---------------------------------------------------------------------------

function fitPrompt() {
  const prompt = $("prompt");
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight + 2, 220)}px`;
}

function updateDashboardLink() {
  const key = apiKey();
  $("dashboard-link").href = key ? `/dashboard?api_key=${encodeURIComponent(key)}` : "/dashboard";
}

function bindSetting(id, name) {
  const input = $(id);
  input.value = settings[name];
  input.addEventListener("input", () => {
    settings[name] = input.value;
    saveSettings();
  });
}

function start() {
  bindSetting("system-prompt", "system");
  bindSetting("temperature", "temperature");
  bindSetting("top-p", "top_p");
  bindSetting("max-tokens", "max_tokens");
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("prompt").addEventListener("input", fitPrompt);
  $("prompt").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData?.files ?? [])].filter((f) => f.type.startsWith("image/"));
    if (files.length && takesImages()) attachFiles(files);
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", () => {
    state.currentId = null;
    saveConversations();
    renderAll();
    $("prompt").focus();
  });
  $("export").addEventListener("click", exportConversation);
  $("toggle-sidebar").addEventListener("click", () => {
    document.body.classList.toggle("sidebar-open");
  });
  $("toggle-settings").addEventListener("click", () => {
    $("settings").hidden = !$("settings").hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!$("settings").hidden));
  });
  $("change-key").addEventListener("click", () => showKeyForm("The API key this server needs:"));
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("key-input").value.trim();
    if (key) localStorage.setItem(STORE.apiKey, key);
    else localStorage.removeItem(STORE.apiKey);
    $("key-form").hidden = true;
    updateDashboardLink();
    loadModels();
  });
  $("model").addEventListener("change", () => {
    settings.model = $("model").value;
    saveSettings();
    fillAdapterPicker();
    renderConversation();
  });
  $("adapter").addEventListener("change", () => {
    settings.adapter = $("adapter").value;
    saveSettings();
  });
  $("attach-input").addEventListener("change", (e) => {
    attachFiles([...e.target.files]);
    e.target.value = "";
  });
  $("messages").addEventListener("click", (e) => {
    const copy = e.target.closest(".code .copy");
    if (!copy) return;
    copyText(copy.closest(".code").querySelector("code").textContent);
    copy.textContent = "Copied";
    setTimeout(() => (copy.textContent = "Copy"), 1200);
  });
  updateDashboardLink();
  renderAll();
  loadModels().then(() => renderConversation());
  $("prompt").focus();
}

document.addEventListener("DOMContentLoaded", start);
