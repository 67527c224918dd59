// The chat page: a conversation kept in the tab (sessionStorage), answers streamed over one WebSocket.
// Plain JS, no build step. Model text is never parsed as HTML: the markdown-ish renderer builds DOM nodes
// with textContent, so whatever the model writes stays text.
"use strict";

(() => {
  const config = JSON.parse(document.getElementById("chat-config").textContent);
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"), status: $("status"), log: $("log"), empty: $("empty"), prompt: $("prompt"),
    send: $("send"), stop: $("stop"), form: $("composer"), newChat: $("new-chat"), system: $("system"),
    temperature: $("temperature"), topP: $("top_p"), maxTokens: $("max_tokens"),
  };
  const STORE = "llmserve.chat.conversation";
  const MODEL = "llmserve.chat.model";

  let socket = null;
  let retryDelay = 500;
  let conversation = JSON.parse(sessionStorage.getItem(STORE) || "[]");
  let current = null; // the answer streaming now: {id, el, body, text, userText}
  let nextId = 1;

  // ------------------------------------------------------------------------------------------ rendering

  function appendInline(parent, text) {
    // `code` and **bold**; everything else as plain text.
    for (const part of text.split(/(`[^`\n]+`|\*\*[^*\n]+\*\*)/)) {
      if (!part) continue;
      if (part.length > 2 && part.startsWith("`") && part.endsWith("`")) {
        const code = document.createElement("code");
        code.textContent = part.slice(1, -1);
        parent.append(code);
      } else if (part.length > 4 && part.startsWith("**") && part.endsWith("**")) {
        const strong = document.createElement("strong");
        strong.textContent = part.slice(2, -2);
        parent.append(strong);
      } else {
        parent.append(document.createTextNode(part));
      }
    }
  }

  function renderMarkdown(el, text) {
    // Fenced code blocks (``` at the start of a line) become <pre><code>; a fence still open while
    // streaming runs to the end.
    el.replaceChildren();
    const fence = /(?:^|\n)```([^\n`]*)\n([\s\S]*?)(?:\n```[^\n]*|$)/g;
    let last = 0;
    for (const match of text.matchAll(fence)) {
      appendInline(el, text.slice(last, match.index));
      const pre = document.createElement("pre");
      const lang = match[1].trim().split(/\s/)[0];
      if (lang) pre.dataset.lang = lang;
      const code = document.createElement("code");
      code.textContent = match[2];
      pre.append(code);
      el.append(pre);
      last = match.index + match[0].length;
    }
    appendInline(el, text.slice(last));
  }

  function addMessage(role, text) {
    ui.empty.hidden = true;
    const el = document.createElement("div");
    el.className = `msg ${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role === "user" ? "You" : "Assistant";
    const body = document.createElement("div");
    body.className = "body";
    renderMarkdown(body, text);
    el.append(label, body);
    ui.log.append(el);
    scrollDown(true);
    return { el, body };
  }

  function note(el, className, text) {
    const line = document.createElement("div");
    line.className = className;
    line.textContent = text;
    el.append(line);
    scrollDown(false);
  }

  function scrollDown(force) {
    const nearBottom = ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 80;
    if (force || nearBottom) ui.log.scrollTop = ui.log.scrollHeight;
  }

  function statsText(end) {
    const parts = [];
    if (end.ttft != null) parts.push(`TTFT ${end.ttft.toFixed(2)} s`);
    if (end.tokens_per_s != null) parts.push(`${end.tokens_per_s.toFixed(1)} tokens/s`);
    parts.push(`${end.usage.completion_tokens} tokens`);
    parts.push(end.finish_reason === "abort" ? "stopped" : `finish: ${end.finish_reason}`);
    return parts.join(" · ");
  }

  function setStatus(text, isError = false) {
    ui.status.textContent = text;
    ui.status.classList.toggle("error", isError);
  }

  function setBusy(busy) {
    ui.send.hidden = busy;
    ui.stop.hidden = !busy;
    ui.send.disabled = !socket || socket.readyState !== WebSocket.OPEN || !ui.model.value;
  }

  function save() {
    sessionStorage.setItem(STORE, JSON.stringify(conversation));
  }

  // ------------------------------------------------------------------------------------------ socket

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}${config.socket_path}`, ["llmserve.chat"]);
    socket.addEventListener("message", (event) => handle(JSON.parse(event.data)));
    socket.addEventListener("open", () => { retryDelay = 500; setStatus("connected"); });
    socket.addEventListener("close", (event) => {
      if (current) finishAnswer(null, "connection lost");
      setBusy(false);
      if (event.code === 4401) return; // refused: reconnecting will not help (the error said why)
      setStatus("disconnected — reconnecting…", true);
      setTimeout(connect, retryDelay);
      retryDelay = Math.min(retryDelay * 2, 10000);
    });
  }

  function handle(msg) {
    switch (msg.type) {
      case "ready":
      case "models":
        showModels(msg.models);
        break;
      case "start":
        if (current && msg.id === current.id) setStatus(`prompt: ${msg.prompt_tokens} tokens`);
        break;
      case "delta":
        if (current && msg.id === current.id) {
          current.text += msg.text;
          renderMarkdown(current.body, current.text);
          scrollDown(false);
        }
        break;
      case "end":
        if (current && msg.id === current.id) finishAnswer(msg, null);
        break;
      case "error":
        if (current && msg.id === current.id) finishAnswer(null, msg.message);
        else setStatus(msg.message, true);
        break;
    }
  }

  function showModels(models) {
    const wanted = ui.model.value || localStorage.getItem(MODEL);
    ui.model.replaceChildren();
    for (const model of models) {
      const option = document.createElement("option");
      option.value = model.id;
      option.textContent = model.parent ? `${model.id} (LoRA on ${model.parent})` : model.id;
      ui.model.append(option);
    }
    if (models.some((m) => m.id === wanted)) ui.model.value = wanted;
    setStatus(models.length ? "ready" : "no model is being served right now", !models.length);
    setBusy(Boolean(current));
  }

  // ------------------------------------------------------------------------------------------ chatting

  function params() {
    const number = (input) => (input.value === "" ? undefined : Number(input.value));
    return { temperature: number(ui.temperature), top_p: number(ui.topP), max_tokens: number(ui.maxTokens) };
  }

  function ask() {
    const text = ui.prompt.value.trim();
    if (!text || current || ui.send.disabled) return;
    ui.prompt.value = "";
    addMessage("user", text);
    conversation.push({ role: "user", content: text });
    save();
    const system = ui.system.value.trim();
    const messages = (system ? [{ role: "system", content: system }] : []).concat(conversation);
    const { el, body } = addMessage("assistant", "");
    el.classList.add("streaming");
    current = { id: nextId++, el, body, text: "", userText: text };
    localStorage.setItem(MODEL, ui.model.value);
    socket.send(JSON.stringify({ type: "chat", id: current.id, model: ui.model.value, messages,
                                 params: params() }));
    setStatus("waiting for the first token…");
    setBusy(true);
  }

  function finishAnswer(end, error) {
    const answer = current;
    current = null;
    answer.el.classList.remove("streaming");
    if (end) {
      conversation.push({ role: "assistant", content: answer.text });
      note(answer.el, "stats", statsText(end));
      setStatus("ready");
    } else {
      // The question was not answered: take it out of the conversation and give it back for a retry.
      conversation.pop();
      if (!ui.prompt.value) ui.prompt.value = answer.userText;
      note(answer.el, "error", error);
      setStatus(error, true);
    }
    save();
    setBusy(false);
  }

  function newChat() {
    if (current) socket.send(JSON.stringify({ type: "stop" }));
    current = null;
    conversation = [];
    save();
    for (const el of ui.log.querySelectorAll(".msg")) el.remove();
    ui.empty.hidden = false;
    setBusy(false);
    ui.prompt.focus();
  }

  ui.form.addEventListener("submit", (event) => { event.preventDefault(); ask(); });
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); ask(); }
  });
  ui.stop.addEventListener("click", () => socket.send(JSON.stringify({ type: "stop" })));
  ui.newChat.addEventListener("click", newChat);
  ui.model.addEventListener("change", () => setBusy(Boolean(current)));
  // New engines come and go (admin load / unload): refresh the list while idle.
  setInterval(() => {
    if (!current && socket && socket.readyState === WebSocket.OPEN) socket.send('{"type": "models"}');
  }, 10000);

  for (const message of conversation) addMessage(message.role, message.content);
  connect();
  setBusy(false);
})();
