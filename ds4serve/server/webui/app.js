// The chat page: conversation, composer, settings, API key. Plain DOM, no framework, no build step.
//
// Model text goes through ds4md.render (text nodes only); user text is shown with textContent. The
// API key lives in sessionStorage (this tab only) and is sent only as the Authorization header of
// this server's API calls. Stopping aborts the fetch: the server sees the client leave, frees the
// slot within a step and counts the cancellation (ds4serve_cancellations_total{reason="client_disconnect"}).
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "ds4serve.apiKey";
  const SETTINGS_STORE = "ds4serve.settings";
  const MAX_IMAGE_BYTES = 20 * 2 ** 20;

  const state = {
    model: null,        // the served model id (from /v1/models)
    history: [],        // OpenAI messages of this conversation (system prompt added per request)
    attachments: [],    // [{url: data URL, name}] for the next message
    controller: null,   // the AbortController of the request in flight
  };

  // ---- API key ---------------------------------------------------------------------------------
  const getKey = () => sessionStorage.getItem(KEY_STORE) || "";

  function setKey(key) {
    if (key) sessionStorage.setItem(KEY_STORE, key); else sessionStorage.removeItem(KEY_STORE);
    $("key-state").textContent = key ? "set" : "none";
  }

  /** Ask for the key in a dialog; resolves true when the user saved one. */
  function askKey(reason) {
    const dialog = $("key-dialog");
    $("key-reason").textContent = reason;
    $("key-input").value = "";
    if (!dialog.open) dialog.showModal();
    $("key-input").focus();
    return new Promise((resolve) => {
      const done = (saved) => {
        $("key-save").onclick = $("key-cancel").onclick = $("key-input").onkeydown = dialog.oncancel = null;
        dialog.close();
        if (saved) setKey($("key-input").value.trim());
        resolve(saved && !!getKey());
      };
      $("key-save").onclick = () => done(true);
      $("key-cancel").onclick = () => done(false);
      dialog.oncancel = (e) => { e.preventDefault(); done(false); };  // Escape
      $("key-input").onkeydown = (e) => { if (e.key === "Enter") { e.preventDefault(); done(true); } };
    });
  }

  /** Run call(key); on a 401 ask for the key and try again (until the user cancels). */
  async function withKey(call) {
    for (;;) {
      try {
        return await call(getKey());
      } catch (exc) {
        if (!(exc instanceof ds4chat.ApiError) || exc.status !== 401) throw exc;
        const reason = getKey() ? "The server refused this API key: " + exc.message
          : "This server requires an API key.";
        if (!(await askKey(reason))) throw exc;
      }
    }
  }

  // ---- settings --------------------------------------------------------------------------------
  function settings() {
    return {
      system: $("system").value,
      temperature: Number($("temperature").value),
      maxTokens: Math.max(1, Math.floor(Number($("max-tokens").value) || 1)),
      thinking: $("thinking").checked,
      ignoreEos: $("ignore-eos").checked,
    };
  }

  function loadSettings() {
    let saved = {};
    try { saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}"); } catch (_) { /* fresh */ }
    if (typeof saved.system === "string") $("system").value = saved.system;
    if (Number.isFinite(saved.temperature)) $("temperature").value = saved.temperature;
    if (Number.isFinite(saved.maxTokens)) $("max-tokens").value = saved.maxTokens;
    $("thinking").checked = !!saved.thinking;
    $("ignore-eos").checked = !!saved.ignoreEos;
    for (const id of ["system", "temperature", "max-tokens", "thinking", "ignore-eos"]) {
      $(id).addEventListener("change", () => localStorage.setItem(SETTINGS_STORE, JSON.stringify(settings())));
    }
  }

  // ---- attachments -----------------------------------------------------------------------------
  function readAsDataURL(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(String(reader.result));
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  async function addFiles(files) {
    for (const file of Array.from(files || [])) {
      if (!file.type.startsWith("image/")) { notice(file.name + " is not an image"); continue; }
      if (file.size > MAX_IMAGE_BYTES) { notice(file.name + " is larger than 20 MiB"); continue; }
      state.attachments.push({ url: await readAsDataURL(file), name: file.name || "pasted image" });
    }
    renderThumbs();
  }

  function thumb(att, onRemove) {
    const box = document.createElement("span");
    box.className = "thumb";
    const img = document.createElement("img");
    img.src = att.url;  // the user's own picture, as a data: URL
    img.alt = img.title = att.name;
    box.appendChild(img);
    if (onRemove) {
      const x = document.createElement("button");
      x.type = "button";
      x.className = "remove";
      x.textContent = "×";
      x.title = "Remove " + att.name;
      x.onclick = onRemove;
      box.appendChild(x);
    }
    return box;
  }

  function renderThumbs() {
    const box = $("attachments");
    box.replaceChildren(...state.attachments.map((att, i) => thumb(att, () => {
      state.attachments.splice(i, 1);
      renderThumbs();
    })));
  }

  // ---- messages --------------------------------------------------------------------------------
  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function addBubble(role) {
    $("empty").hidden = true;
    const msg = document.createElement("div");
    msg.className = "msg " + role;
    $("messages").appendChild(msg);
    return msg;
  }

  function addUserBubble(text, images) {
    const msg = addBubble("user");
    if (images.length) {
      const row = document.createElement("div");
      row.className = "images";
      images.forEach((att) => row.appendChild(thumb(att, null)));
      msg.appendChild(row);
    }
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    msg.appendChild(body);
    scrollDown();
    return msg;
  }

  function notice(text) {
    const msg = addBubble("notice");
    msg.textContent = text;
    scrollDown();
  }

  function userContent(text, images) {
    if (!images.length) return text;
    const parts = images.map((att) => ({ type: "image_url", image_url: { url: att.url } }));
    if (text) parts.push({ type: "text", text });
    return parts;
  }

  function requestBody(s) {
    const messages = s.system.trim() ? [{ role: "system", content: s.system }] : [];
    const body = {
      model: state.model || undefined, messages: messages.concat(state.history), stream: true,
      stream_options: { include_usage: true }, temperature: s.temperature, max_tokens: s.maxTokens,
      chat_template_kwargs: { thinking: s.thinking },
    };
    if (s.ignoreEos) body.ignore_eos = true;
    return body;
  }

  // ---- sending ---------------------------------------------------------------------------------
  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
  }

  async function sendMessage() {
    if (state.controller) return;
    const text = $("prompt").value.trim();
    const images = state.attachments.slice();
    if (!text && !images.length) return;
    $("prompt").value = "";
    state.attachments = [];
    renderThumbs();
    addUserBubble(text, images);
    const history = state.history;  // "New chat" during the stream starts another list: this one is left
    history.push({ role: "user", content: userContent(text, images) });
    const reply = new window.ds4reply.Reply(addBubble("assistant"), scrollDown);
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    try {
      const s = settings();
      await withKey((key) => {
        reply.start();
        return ds4chat.streamChat(requestBody(s), key, controller.signal, (c) => reply.chunk(c));
      });
      reply.finish("done");
      history.push({ role: "assistant", content: reply.content });
    } catch (exc) {
      if (exc && exc.name === "AbortError") {
        reply.finish("stopped");
        if (reply.content) history.push({ role: "assistant", content: reply.content });
        else history.pop();  // nothing came back: the question is not part of the conversation
      } else {
        reply.fail(exc);
        history.pop();
      }
    } finally {
      if (state.controller === controller) state.controller = null;
      setBusy(false);
    }
  }

  function newChat() {
    if (state.controller) state.controller.abort();
    state.history = [];
    state.attachments = [];
    renderThumbs();
    $("messages").replaceChildren($("empty"));
    $("empty").hidden = false;
    $("prompt").focus();
  }

  async function loadModel() {
    try {
      const list = await withKey((key) => ds4chat.getJSON("/v1/models", key));
      state.model = list.data && list.data.length ? list.data[0].id : null;
      $("model").textContent = state.model || "(no model)";
    } catch (exc) {
      $("model").textContent = "not connected";
      notice("Could not list the models: " + (exc.status ? exc.status + " " : "") + exc.message);
    }
  }

  // ---- wiring ----------------------------------------------------------------------------------
  function wireDrop() {
    let depth = 0;
    const overlay = $("drop-overlay");
    const hasFiles = (e) => e.dataTransfer && Array.from(e.dataTransfer.types || []).includes("Files");
    document.addEventListener("dragenter", (e) => { if (hasFiles(e)) { depth++; overlay.hidden = false; } });
    document.addEventListener("dragleave", () => { if (--depth <= 0) { depth = 0; overlay.hidden = true; } });
    document.addEventListener("dragover", (e) => { if (hasFiles(e)) e.preventDefault(); });
    document.addEventListener("drop", (e) => {
      e.preventDefault();
      depth = 0;
      overlay.hidden = true;
      addFiles(e.dataTransfer && e.dataTransfer.files);
    });
  }

  function wire() {
    $("send").onclick = sendMessage;
    $("stop").onclick = () => state.controller && state.controller.abort();
    $("new-chat").onclick = newChat;
    $("file").onchange = async (e) => { await addFiles(e.target.files); e.target.value = ""; };
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendMessage(); }
    });
    $("prompt").addEventListener("paste", (e) => {
      const files = e.clipboardData && e.clipboardData.files;
      if (files && files.length) { e.preventDefault(); addFiles(files); }
    });
    $("key-change").onclick = async () => { if (await askKey("API key for this server:")) loadModel(); };
    $("key-forget").onclick = () => setKey("");
    $("settings-toggle").onclick = () => {
      const hidden = $("settings").classList.toggle("hidden");
      $("settings-toggle").setAttribute("aria-expanded", String(!hidden));
    };
    wireDrop();
  }

  window.addEventListener("DOMContentLoaded", () => {
    setKey(getKey());
    loadSettings();
    wire();
    loadModel();
    $("prompt").focus();
  });
  // for tests and the curious: the page's state and its key prompt (never the key itself in the page)
  window.ds4page = Object.freeze({ state, addFiles, newChat });
})();
