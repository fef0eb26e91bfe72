// pagoda's chat page: plain JavaScript, no dependencies, nothing fetched but this
// server's own API (GET /v1/models, POST /v1/chat/completions streamed).
//
//   markdown     renderMarkdown, highlight: markdown.js, loaded first
//   storage      conversations, settings and the API key in localStorage
//   models       the model and LoRA adapter pickers, from /v1/models
//   answers      one streamed request at a time: SSE parsed, Stop aborts it
//   views        the conversation list, the messages, the composer: views.js, loaded last
"use strict";

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

