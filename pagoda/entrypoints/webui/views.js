// The chat page's views (loaded after chat.js, whose state and requests they show):
// the conversation list, the messages, the composer, and the page's start.
"use strict";

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
