// Sluice chat: a streamed chat client for the proxy's OpenAI-compatible API.
//
// No framework, no build step, no external resource. The answer is read from the SSE stream of
// POST /v1/chat/completions with fetch and a ReadableStream reader; tokens are batched and
// drawn at most once per animation frame, so a fast stream costs one DOM write per frame, not
// one per token. Stop aborts the fetch: the connection closes, and the proxy cancels the work
// (an upstream stream is closed, a local model stops at its next decode step).
//
// Answers are Markdown, rendered with marked and then sanitised with DOMPurify (both vendored
// under static/vendor/, see scripts/vendor_js.py): model output is untrusted. Raw HTML in an
// answer is shown as text, never as markup. Conversations live in localStorage, one key per
// chat ("sluice.chat.<id>"), so two tabs never overwrite each other's chats.
"use strict";

(function () {
  const STORAGE_KEY = "sluice.apiKey";
  const STORAGE_MODEL = "sluice.model";
  const STORAGE_SETTINGS = "sluice.settings"; // max tokens, temperature, top_p, system prompt
  const STORAGE_THEME = "sluice.theme"; // "dark" | "light"; absent: follow the system
  const STORAGE_PANEL = "sluice.settingsOpen"; // "1" | "0"; absent: open on wide screens
  const STORAGE_CURRENT = "sluice.currentChat";
  const CHAT_PREFIX = "sluice.chat.";
  // The stats line is redrawn at most this often while streaming (the text every frame).
  const STATS_INTERVAL_MS = 100;
  // How often /healthz is asked while a model loads.
  const HEALTH_POLL_MS = 1000;
  // Within this many pixels of the bottom counts as "at the latest".
  const BOTTOM_SLACK_PX = 24;

  // ------------------------------------------------------------------ SSE, sans-IO

  // Splits decoded text into server-sent events. Feed it whatever each read() returns (after a
  // TextDecoder with {stream: true}): an event split across reads is held until its blank line
  // arrives. Returns the data payload of each complete event (multi-line data joined with
  // "\n"); comments and events without data are skipped. CRLF and CR line ends are accepted,
  // also when a CRLF is split between two reads.
  class SSEParser {
    constructor() {
      this.buffer = "";
      this.carryCR = false;
    }

    push(text) {
      if (this.carryCR) {
        text = "\r" + text;
        this.carryCR = false;
      }
      if (text.endsWith("\r")) {
        this.carryCR = true;
        text = text.slice(0, -1);
      }
      if (text.includes("\r")) text = text.replace(/\r\n?/g, "\n");
      const buffer = this.buffer + text;
      const payloads = [];
      let start = 0;
      let end;
      while ((end = buffer.indexOf("\n\n", start)) >= 0) {
        const data = SSEParser.dataOf(buffer.slice(start, end));
        if (data !== null) payloads.push(data);
        start = end + 2;
      }
      this.buffer = buffer.slice(start);
      return payloads;
    }

    // Whatever is left when the stream ends is an incomplete event: the SSE spec drops it.
    get pending() {
      return this.buffer.replace(/^\n+/, "");
    }

    static dataOf(block) {
      const data = [];
      for (const line of block.split("\n")) {
        if (line === "" || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") data.push(value);
      }
      return data.length ? data.join("\n") : null;
    }
  }

  // ------------------------------------------------------------------ errors in words

  class ProblemError extends Error {
    constructor(message, code) {
      super(message);
      this.code = code || null;
    }
  }

  // An error event from the server: it ends the stream itself right after.
  class InBandError extends ProblemError {}

  // Seconds from a Retry-After header (delta-seconds or an HTTP date); null when absent.
  function retryAfterSeconds(value) {
    if (!value) return null;
    const trimmed = value.trim();
    if (/^\d+$/.test(trimmed)) return parseInt(trimmed, 10);
    const date = Date.parse(trimmed);
    if (Number.isNaN(date)) return null;
    return Math.max(0, Math.ceil((date - Date.now()) / 1000));
  }

  // The message of an OpenAI-shaped error body ({"error": {"message": ...}}), or null.
  function errorMessageOf(body) {
    if (body && typeof body === "object" && body.error) {
      const error = body.error;
      if (typeof error === "string") return error;
      if (typeof error.message === "string" && error.message) return error.message;
    }
    return null;
  }

  // Reads a failed response and says what went wrong, for a person: a ProblemError carrying
  // the error's code (model_loading, rate_limit_exceeded...) when the body had one.
  async function httpProblem(response, model) {
    let detail = null;
    let code = null;
    try {
      const text = await response.text();
      try {
        const body = JSON.parse(text);
        detail = errorMessageOf(body);
        code = (body && body.error && body.error.code) || null;
      } catch (_) {
        detail = text.trim().slice(0, 300) || null;
      }
    } catch (_) {
      // The body could not be read: the status says enough.
    }
    const status = response.status;
    const said = detail ? ` (${detail})` : "";
    if (status === 429 || status === 503) {
      const seconds = retryAfterSeconds(response.headers.get("Retry-After"));
      const when = seconds === null ? "in a moment" : `in ${seconds} s`;
      if (code === "model_loading") {
        return new ProblemError(`${model || "The model"} is still loading, try again ${when}.`, code);
      }
      const who =
        code === "rate_limit_exceeded" || code === "concurrency_limit_exceeded"
          ? "Your API key is over its limit"
          : "The model is busy";
      return new ProblemError(`${who}, try again ${when}.` + said, code);
    }
    if (status === 401) {
      return new ProblemError(
        "The server needs an API key, or this one is wrong: enter it in the API key field." + said,
        code || "unauthorized",
      );
    }
    const reason = detail || response.statusText || "no details";
    return new ProblemError(`The server answered ${status}: ${reason}`, code);
  }

  function describeFailure(error, phase) {
    if (error instanceof ProblemError) return error.message;
    const what = error && error.message ? error.message : String(error);
    if (phase === "connect") {
      return `Could not reach the server (${what}). Is the proxy running?`;
    }
    return `The connection was lost in the middle of the answer (${what}).`;
  }

  // ------------------------------------------------------------------ Markdown, sanitised

  // Renders untrusted Markdown into a container. marked makes HTML; DOMPurify keeps only
  // harmless markup (no script, no event handler, no style, no form, no image: images become
  // links, the page loads nothing from elsewhere); raw HTML written by the model is escaped by
  // marked's renderer before that, so it shows as text. Top-level blocks that did not change
  // since the previous frame are left in place: while an answer streams only its last block is
  // rebuilt, and a selection in an earlier paragraph survives.
  const Markdown = (() => {
    const lib = window.marked;
    const purify = window.DOMPurify;
    if (!lib || typeof lib.Marked !== "function" || !purify || !purify.isSupported) return null;

    const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
    const escapeHtml = (text) => String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);

    const parser = new lib.Marked({ gfm: true, breaks: true, async: false });
    parser.use({
      renderer: {
        html({ text, block }) {
          const escaped = escapeHtml(text);
          return block ? `<p class="raw-html">${escaped.replace(/\n+$/, "")}</p>\n` : escaped;
        },
        // The page's own headings are h1 (the page) and h2 (who speaks): an answer's start at h3.
        heading({ tokens, depth }) {
          const level = Math.min(depth + 2, 6);
          return `<h${level}>${this.parser.parseInline(tokens)}</h${level}>\n`;
        },
        image({ href, text }) {
          const label = escapeHtml(text || href || "");
          return href ? `<a href="${escapeHtml(href)}">[image: ${label}]</a>` : label;
        },
      },
    });

    const CLASS_OK = /^(language-[\w+#.-]+|raw-html)$/;
    purify.addHook("uponSanitizeAttribute", (_node, data) => {
      if (data.attrName === "class" && !CLASS_OK.test(data.attrValue)) data.keepAttr = false;
    });
    purify.addHook("afterSanitizeAttributes", (node) => {
      if (node.tagName === "A" && node.hasAttribute("href")) {
        node.setAttribute("target", "_blank");
        node.setAttribute("rel", "noopener noreferrer");
      }
    });
    const CONFIG = {
      USE_PROFILES: { html: true },
      FORBID_TAGS: [
        "style", "form", "input", "button", "textarea", "select", "option", "label", "img",
        "picture", "source", "video", "audio", "track", "iframe", "object", "embed", "dialog",
      ],
      FORBID_ATTR: ["style", "id", "name", "srcset", "action", "formaction", "autofocus"],
    };

    // Markdown to safe HTML text; and HTML to safe HTML text (DOMPurify alone, for tests).
    function sanitize(text) {
      return purify.sanitize(parser.parse(text), CONFIG);
    }

    function sanitizeHtml(html) {
      return purify.sanitize(html, CONFIG);
    }

    function fragment(text) {
      return purify.sanitize(parser.parse(text), { ...CONFIG, RETURN_DOM_FRAGMENT: true });
    }

    // A code block gets a head: its language and a Copy button (labels drawn by CSS, so the
    // answer's text stays exactly the code).
    function decorate(node) {
      if (node.nodeType !== Node.ELEMENT_NODE) return node;
      let top = node;
      const pres = node.tagName === "PRE" ? [node] : Array.from(node.querySelectorAll("pre"));
      for (const pre of pres) {
        const wrap = document.createElement("div");
        wrap.className = "code-block";
        const head = document.createElement("div");
        head.className = "code-head";
        const code = pre.querySelector("code");
        const lang = code && /(?:^|\s)language-([\w+#.-]+)/.exec(code.className);
        head.dataset.lang = lang ? lang[1] : "";
        head.append(copyButton("Copy code", "copy-code"));
        pre.replaceWith(wrap);
        wrap.append(head, pre);
        if (pre === node) top = wrap;
      }
      return top;
    }

    function render(container, text) {
      const fresh = Array.from(fragment(text).childNodes);
      const old = Array.from(container.childNodes);
      fresh.forEach((node, i) => {
        const key = node.nodeType === Node.ELEMENT_NODE ? node.outerHTML : node.nodeValue;
        const existing = old[i];
        if (existing && existing.sluiceKey === key) return;
        const shown = decorate(node);
        shown.sluiceKey = key;
        if (existing) container.replaceChild(shown, existing);
        else container.appendChild(shown);
      });
      for (let i = fresh.length; i < old.length; i++) old[i].remove();
    }

    return { render, sanitize, sanitizeHtml };
  })();

  function renderAnswer(container, text) {
    if (Markdown) {
      Markdown.render(container, text);
    } else {
      container.classList.add("plain"); // the libraries did not load: plain text, still safe
      container.textContent = text;
    }
  }

  // ------------------------------------------------------------------ the page

  const $ = (id) => document.getElementById(id);
  const els = {
    model: $("model"),
    maxTokens: $("max-tokens"),
    temperature: $("temperature"),
    topP: $("top-p"),
    apiKey: $("api-key"),
    system: $("system-prompt"),
    settings: $("settings"),
    settingsToggle: $("settings-toggle"),
    sidebar: $("sidebar"),
    chatsToggle: $("chats-toggle"),
    chatList: $("chat-list"),
    noChats: $("no-chats"),
    theme: $("theme"),
    conversation: $("conversation"),
    jump: $("jump"),
    empty: $("empty"),
    error: $("error"),
    form: $("composer"),
    message: $("message"),
    status: $("status"),
    send: $("send"),
    stop: $("stop"),
    newChat: $("new-chat"),
  };
  const EMPTY_TEXT = els.empty.textContent;

  let current = null; // the turn being streamed, if any
  let loading = {}; // models the server is still loading: name -> stage ("" when not said)

  function storageGet(key) {
    try {
      return window.localStorage.getItem(key) || "";
    } catch (_) {
      return ""; // storage disabled: the page still works, it just forgets
    }
  }

  // Returns false when the browser refused (storage full or disabled).
  function storageSet(key, value) {
    try {
      if (value) window.localStorage.setItem(key, value);
      else window.localStorage.removeItem(key);
      return true;
    } catch (_) {
      return false;
    }
  }

  function headers(json) {
    const result = {};
    if (json) {
      result["Content-Type"] = "application/json";
      result["Accept"] = "text/event-stream";
    }
    const key = els.apiKey.value.trim();
    if (key) result["Authorization"] = `Bearer ${key}`;
    return result;
  }

  function showError(text) {
    els.error.textContent = text;
    els.error.hidden = false;
  }

  function clearError() {
    els.error.textContent = "";
    els.error.hidden = true;
  }

  function setStatus(text) {
    els.status.textContent = text;
  }

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function formatSeconds(ms) {
    return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
  }

  // ------------------------------------------------------------------ copying

  async function copyText(text) {
    try {
      if (navigator.clipboard && window.isSecureContext) {
        await navigator.clipboard.writeText(text);
        return true;
      }
    } catch (_) {
      // refused (no permission, page not focused): try the old way
    }
    const area = element("textarea", "offscreen");
    area.value = text;
    area.setAttribute("readonly", "");
    area.setAttribute("aria-hidden", "true");
    document.body.appendChild(area);
    area.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch (_) {
      ok = false;
    }
    area.remove();
    return ok;
  }

  // A Copy button; its visible label is drawn by CSS ("Copy", "Copied", "Copy failed").
  function copyButton(label, kind) {
    const button = element("button", `copy ${kind}`);
    button.type = "button";
    button.setAttribute("aria-label", label);
    button.title = label;
    button.dataset.label = label;
    return button;
  }

  async function copyFrom(button, text) {
    const ok = await copyText(text);
    button.classList.remove("copied", "copy-failed");
    button.classList.add(ok ? "copied" : "copy-failed");
    button.setAttribute("aria-label", ok ? "Copied" : "Copy failed");
    clearTimeout(button.sluiceTimer);
    button.sluiceTimer = setTimeout(() => {
      button.classList.remove("copied", "copy-failed");
      button.setAttribute("aria-label", button.dataset.label);
    }, 1500);
  }

  // ------------------------------------------------------------------ following the answer

  // Keeps the newest text in view while it streams, unless the reader scrolled up: then it
  // stays where they put it, and "Jump to latest" brings them back (so does reaching the
  // bottom by hand, or sending a message). Any growth is caught: text, the stats line, a
  // resized window or composer (a ResizeObserver watches the log and every message).
  const follower = {
    follow: true,
    lastTop: 0,

    distance() {
      const c = els.conversation;
      return c.scrollHeight - c.scrollTop - c.clientHeight;
    },

    toBottom() {
      const c = els.conversation;
      c.scrollTop = c.scrollHeight;
      this.lastTop = c.scrollTop;
    },

    // After anything that may have changed the height.
    pin() {
      if (this.follow) this.toBottom();
      this.update();
    },

    jump() {
      this.follow = true;
      this.toBottom();
      this.update();
    },

    update() {
      els.jump.hidden = this.follow || this.distance() <= BOTTOM_SLACK_PX;
    },

    onScroll() {
      const top = els.conversation.scrollTop;
      const distance = this.distance();
      if (distance <= 2 || (distance <= BOTTOM_SLACK_PX && top >= this.lastTop)) {
        this.follow = true; // at the bottom (by hand, or the content shrank under us)
      } else if (top < this.lastTop) {
        this.follow = false; // moved up: the reader wants to read something
      }
      this.lastTop = top;
      this.update();
    },
  };

  const resizes =
    typeof ResizeObserver === "function" ? new ResizeObserver(() => follower.pin()) : null;
  if (resizes) resizes.observe(els.conversation);

  // ------------------------------------------------------------------ conversations, stored

  // A chat: {id, title, created, updated, messages: [{role, content, model?, meta?, status?}]};
  // an assistant message's status is done | length | stopped | failed.
  function newChatObject() {
    const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
    return { id, title: "", created: Date.now(), updated: Date.now(), messages: [] };
  }

  function titleOf(chat) {
    const first = chat.messages.find((m) => m.role === "user");
    const line = first ? first.content.trim().split("\n")[0] : "";
    return line.length > 60 ? line.slice(0, 59) + "…" : line || "New chat";
  }

  function readChat(id) {
    try {
      const chat = JSON.parse(storageGet(CHAT_PREFIX + id) || "null");
      if (chat && typeof chat.id === "string" && Array.isArray(chat.messages)) {
        chat.messages = chat.messages.filter(
          (m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string",
        );
        return chat;
      }
    } catch (_) {
      // not ours, or damaged: ignored
    }
    return null;
  }

  function listChats() {
    const chats = [];
    let keys = [];
    try {
      keys = Object.keys(window.localStorage);
    } catch (_) {
      return chats;
    }
    for (const key of keys) {
      if (!key.startsWith(CHAT_PREFIX)) continue;
      const chat = readChat(key.slice(CHAT_PREFIX.length));
      if (chat && chat.messages.length) chats.push(chat);
    }
    return chats.sort((a, b) => (b.updated || 0) - (a.updated || 0));
  }

  function saveChat(target) {
    if (!target.messages.length) {
      storageSet(CHAT_PREFIX + target.id, "");
      return;
    }
    target.updated = Date.now();
    target.title = titleOf(target);
    if (!storageSet(CHAT_PREFIX + target.id, JSON.stringify(target))) {
      showError(
        "This browser would not store the conversation (storage full or disabled): " +
          "it will not survive a reload. Deleting old chats frees space.",
      );
    }
  }

  let chat = readChat(storageGet(STORAGE_CURRENT)) || newChatObject();
  storageSet(STORAGE_CURRENT, chat.id);
  let views = []; // one per message of `chat`, in order

  // ------------------------------------------------------------------ messages on the page

  function setMeta(view, status, text) {
    const { article, meta } = view;
    for (const name of ["stopped", "failed", "length"]) {
      article.classList.toggle(name, status === name);
    }
    if (status === "length") {
      const mark = element("strong", "mark", "⚠ Cut off at the max tokens limit");
      mark.title = "The answer reached max_tokens (finish_reason: length). Raise Max tokens.";
      meta.replaceChildren(mark, text ? ` · ${text}` : "");
    } else {
      meta.textContent = text || "";
    }
  }

  // An article for a message: who, the text, then the stats line. A question's buttons sit
  // beside "You"; an answer's at its end, beside its stats.
  function makeView(message) {
    els.empty.hidden = true;
    const { role } = message;
    const article = element("article", `message ${role}`);
    const head = element("div", "head");
    const who = element("h2", "who", role === "user" ? "You" : message.model || "Assistant");
    const body = element("div", role === "user" ? "text" : "text markdown");
    const foot = element("div", "foot");
    const meta = element("p", "meta");
    const tools = element("div", "tools");
    head.append(who);
    foot.append(meta);
    (role === "user" ? head : foot).append(tools);
    article.append(head, body);
    if (role !== "user") article.append(foot);
    const view = { article, body, meta, tools, message, regenerate: null };
    if (role === "user") {
      body.textContent = message.content;
      const edit = element("button", "secondary small needs-idle", "Edit");
      edit.type = "button";
      edit.setAttribute("aria-label", "Edit message");
      edit.title = "Edit this message and send it again (the answers after it are dropped)";
      edit.addEventListener("click", () => startEdit(view));
      tools.append(copyButton("Copy message", "copy-message"), edit);
    } else {
      renderAnswer(body, message.content);
      const regenerate = element("button", "secondary small needs-idle", "Regenerate");
      regenerate.type = "button";
      regenerate.title = "Ask for this answer again";
      regenerate.hidden = true;
      regenerate.addEventListener("click", () => regenerateLast());
      tools.append(copyButton("Copy answer", "copy-answer"), regenerate);
      view.regenerate = regenerate;
      setMeta(view, message.status, message.meta);
    }
    els.conversation.appendChild(article);
    if (resizes) resizes.observe(article);
    return view;
  }

  function removeView(view) {
    if (resizes) resizes.unobserve(view.article);
    view.article.remove();
  }

  function drawChat() {
    for (const view of views) removeView(view);
    for (const article of els.conversation.querySelectorAll("article")) article.remove();
    views = chat.messages.map((message) => makeView(message));
    els.empty.hidden = views.length > 0;
    updateControls();
    follower.jump();
  }

  // ------------------------------------------------------------------ the list of chats

  function drawChatList() {
    const chats = listChats();
    const items = chats.map((c) => {
      const item = element("li", "chat-item");
      const open = element("button", "chat-open", c.title || titleOf(c));
      open.type = "button";
      if (c.id === chat.id) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => openChat(c.id));
      const remove = element("button", "chat-delete", "✕");
      remove.type = "button";
      const label = `Delete chat: ${open.textContent}`;
      remove.setAttribute("aria-label", label);
      remove.title = label;
      // Two clicks: the first asks, the second deletes (no dialog box).
      remove.addEventListener("click", () => {
        if (remove.classList.contains("confirm")) {
          deleteChat(c.id);
          return;
        }
        remove.classList.add("confirm");
        remove.textContent = "Delete?";
        remove.setAttribute("aria-label", `Really delete chat: ${open.textContent}`);
        setTimeout(() => {
          if (!remove.isConnected) return;
          remove.classList.remove("confirm");
          remove.textContent = "✕";
          remove.setAttribute("aria-label", label);
        }, 4000);
      });
      item.append(open, remove);
      return item;
    });
    els.chatList.replaceChildren(...items);
    els.noChats.textContent = chats.length
      ? "Conversations are kept in this browser."
      : "No past chats yet. They are kept in this browser.";
  }

  // Stops the answer in flight and waits until it is recorded in its own chat.
  async function settle() {
    if (!current) return;
    const turn = current;
    turn.controller.abort();
    await turn.finished;
  }

  async function openChat(id) {
    await settle();
    chat = readChat(id) || newChatObject();
    storageSet(STORAGE_CURRENT, chat.id);
    clearError();
    setStatus("");
    drawChat();
    drawChatList();
    setDrawer(false);
    els.message.focus();
  }

  async function newChat() {
    await settle();
    chat = newChatObject();
    storageSet(STORAGE_CURRENT, chat.id);
    drawChat();
    drawChatList();
    clearError();
    setStatus("");
    setDrawer(false);
    els.message.focus();
  }

  async function deleteChat(id) {
    if (current && current.chat.id === id) current.discarded = true;
    if (current && current.chat.id === id) await settle();
    storageSet(CHAT_PREFIX + id, "");
    if (chat.id === id) {
      await newChat();
    } else {
      drawChatList();
    }
  }

  // ------------------------------------------------------------------ settings

  function loadSettings() {
    let saved = {};
    try {
      saved = JSON.parse(storageGet(STORAGE_SETTINGS) || "{}") || {};
    } catch (_) {
      saved = {};
    }
    const text = (value) => (typeof value === "string" ? value : "");
    els.maxTokens.value = text(saved.maxTokens);
    els.temperature.value = text(saved.temperature);
    els.topP.value = text(saved.topP);
    els.system.value = text(saved.system);
    fitSystemPrompt();
  }

  function saveSettings() {
    storageSet(
      STORAGE_SETTINGS,
      JSON.stringify({
        maxTokens: els.maxTokens.value,
        temperature: els.temperature.value,
        topP: els.topP.value,
        system: els.system.value,
      }),
    );
  }

  // The system prompt grows with its text, up to a few lines (then it scrolls).
  function fitSystemPrompt() {
    const box = els.system;
    box.style.height = "auto";
    box.style.height = `${Math.min(box.scrollHeight + 2, 160)}px`;
  }

  function setSettingsOpen(open, remember) {
    els.settings.hidden = !open;
    els.settingsToggle.setAttribute("aria-expanded", open ? "true" : "false");
    if (remember) storageSet(STORAGE_PANEL, open ? "1" : "0");
    if (open) fitSystemPrompt();
  }

  // The list of chats, as a drawer on narrow screens (on wide ones it is always there).
  function setDrawer(open) {
    const was = document.body.classList.contains("drawer-open");
    document.body.classList.toggle("drawer-open", open);
    els.chatsToggle.setAttribute("aria-expanded", open ? "true" : "false");
    if (open && !was) els.newChat.focus();
    else if (!open && was && els.sidebar.contains(document.activeElement)) els.chatsToggle.focus();
  }

  // Parsed numbers, or undefined for an empty field (the server's default then applies).
  function numberOf(input, parse) {
    const raw = input.value.trim();
    if (!raw) return undefined;
    const value = parse(raw);
    return Number.isFinite(value) ? value : undefined;
  }

  // ------------------------------------------------------------------ theme

  const systemDark = window.matchMedia("(prefers-color-scheme: dark)");

  function applyTheme() {
    const choice = storageGet(STORAGE_THEME);
    const root = document.documentElement;
    if (choice === "dark" || choice === "light") root.dataset.theme = choice;
    else delete root.dataset.theme;
    const dark = choice === "dark" || (choice !== "light" && systemDark.matches);
    els.theme.setAttribute("aria-pressed", dark ? "true" : "false");
    els.theme.textContent = dark ? "☾" : "☀";
  }

  // Dark or light by hand; choosing what the system says anyway goes back to following it.
  function toggleTheme() {
    const dark = els.theme.getAttribute("aria-pressed") === "true";
    const next = dark ? "light" : "dark";
    const system = systemDark.matches ? "dark" : "light";
    storageSet(STORAGE_THEME, next === system ? "" : next);
    applyTheme();
  }

  // ------------------------------------------------------------------ models, and loading

  function loadingNames() {
    return Object.keys(loading);
  }

  function selectedIsLoading() {
    const names = loadingNames();
    if (!names.length) return false;
    // Unnamed loading, or the model picked (or none picked yet) is one of them.
    return names.includes("") || !els.model.value || names.includes(els.model.value);
  }

  // Asks /healthz what is loading. Returns true (loading), false (ready) or null (no answer:
  // an older server without /healthz, or the network; the state is left as it was).
  async function checkHealth() {
    let body;
    try {
      const response = await fetch("healthz", { cache: "no-store" });
      if (!response.ok && response.status !== 503) return null;
      body = await response.json();
    } catch (_) {
      return null;
    }
    if (!body || typeof body !== "object") return null;
    const next = {};
    if (body.status === "loading") {
      const what = body.loading;
      if (Array.isArray(what)) {
        for (const name of what) next[String(name)] = "";
      } else if (what && typeof what === "object") {
        for (const [name, stage] of Object.entries(what)) {
          next[name] = typeof stage === "string" ? stage : "";
        }
      }
      if (!Object.keys(next).length) next[""] = "";
    }
    loading = next;
    return Object.keys(next).length > 0;
  }

  function loadingText() {
    const parts = loadingNames().map((name) => {
      const stage = loading[name];
      const who = name || "the model";
      return stage ? `${who} (${stage})` : who;
    });
    return `Loading ${parts.join(", ")}…`;
  }

  function drawLoading() {
    const names = loadingNames();
    for (const option of els.model.options) {
      if (!option.value) continue;
      option.textContent = option.value + (names.includes(option.value) ? " (loading…)" : "");
    }
    if (names.length) {
      if (!current) setStatus(loadingText());
      els.empty.textContent = `${loadingText()} Send is enabled once it is ready.`;
    } else {
      els.empty.textContent = EMPTY_TEXT;
    }
    updateControls();
  }

  let healthTimer = 0;

  function watchHealth() {
    if (!healthTimer) healthTimer = setTimeout(pollHealth, HEALTH_POLL_MS);
  }

  async function pollHealth() {
    healthTimer = 0;
    const before = loadingNames();
    const still = await checkHealth();
    if (still !== false) {
      drawLoading();
      watchHealth(); // loading, or no answer while it was: ask again
      return;
    }
    drawLoading();
    if (before.length) {
      await loadModels();
      const names = before.filter((name) => name).join(", ");
      if (!current) setStatus(names ? `${names} is ready.` : "Ready.");
    }
  }

  async function loadModels() {
    const previous = els.model.value || storageGet(STORAGE_MODEL);
    let response;
    try {
      response = await fetch("v1/models", { headers: headers(false), cache: "no-store" });
    } catch (error) {
      els.model.replaceChildren(new Option("(unavailable)", ""));
      showError(`Could not load the model list: ${describeFailure(error, "connect")}`);
      return;
    }
    if (!response.ok) {
      const problem = await httpProblem(response);
      if (problem.code === "model_loading") {
        watchHealth(); // the list comes once the model is there
        return;
      }
      els.model.replaceChildren(new Option("(unavailable)", ""));
      showError(`Could not load the model list. ${problem.message}`);
      if (problem.code === "unauthorized") setSettingsOpen(true, false);
      return;
    }
    const body = await response.json();
    const ids = (body.data || []).map((m) => m.id).filter((id) => typeof id === "string");
    if (!ids.length) {
      els.model.replaceChildren(new Option("(no models)", ""));
      showError("This server serves no models.");
      return;
    }
    els.model.replaceChildren(...ids.map((id) => new Option(id, id)));
    els.model.value = ids.includes(previous) ? previous : ids[0];
    drawLoading();
    if (!current) clearError();
  }

  async function start() {
    const isLoading = await checkHealth();
    if (isLoading) watchHealth();
    drawLoading();
    await loadModels();
  }

  // ------------------------------------------------------------------ one turn

  class Turn {
    constructor(target, model, fresh) {
      this.chat = target;
      this.model = model;
      this.fresh = fresh; // a new user message (taken back when nothing comes), or a retry
      this.controller = new AbortController();
      this.started = performance.now();
      this.firstAt = null;
      this.lastAt = null;
      this.text = ""; // everything received
      this.dirty = false; // received, not drawn yet
      this.chunks = 0; // content deltas received (about one per token)
      this.usage = null;
      this.finishReason = null;
      this.frame = 0;
      this.renders = 0;
      this.renderCost = 0; // ms the last render took
      this.renderedAt = 0;
      this.statsAt = 0;
      this.discarded = false;
      this.finished = new Promise((resolve) => {
        this.resolveFinished = resolve;
      });
      this.view = makeView({ role: "assistant", content: "", model });
      this.view.article.classList.add("streaming");
      this.view.meta.textContent = "Waiting for the first token…";
    }

    receive(content) {
      const now = performance.now();
      if (this.firstAt === null) this.firstAt = now;
      this.lastAt = now;
      this.chunks += 1;
      this.text += content;
      this.dirty = true;
      this.schedule();
    }

    schedule() {
      if (!this.frame) this.frame = requestAnimationFrame(() => this.render(false));
    }

    // Draws what arrived since the last frame: one render, however many tokens. A long answer
    // whose render takes a while is drawn less often (never more than a quarter of the time).
    render(final) {
      this.frame = 0;
      const now = performance.now();
      if (!final && this.dirty && now - this.renderedAt < this.renderCost * 3) {
        this.schedule();
        return;
      }
      if (this.dirty) {
        this.dirty = false;
        renderAnswer(this.view.body, this.text);
        this.renders += 1;
        this.renderedAt = performance.now();
        this.renderCost = this.renderedAt - now;
      }
      if (final || now - this.statsAt >= STATS_INTERVAL_MS) {
        this.statsAt = now;
        const stats = this.stats();
        this.view.meta.textContent = stats;
        if (!final) setStatus(`Streaming… ${stats}`);
      }
      follower.pin();
    }

    tokens() {
      const usage = this.usage && this.usage.completion_tokens;
      return typeof usage === "number" ? usage : this.chunks;
    }

    stats() {
      if (this.firstAt === null) return "Waiting for the first token…";
      const parts = [`first token ${formatSeconds(this.firstAt - this.started)}`];
      const tokens = this.tokens();
      parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
      // The decode rate: tokens after the first, over the time since the first.
      const end = this.lastAt === null ? performance.now() : this.lastAt;
      const elapsed = (end - this.firstAt) / 1000;
      if (tokens > 1 && elapsed > 0) parts.push(`${((tokens - 1) / elapsed).toFixed(1)} tokens/s`);
      return parts.join(" · ");
    }

    flush() {
      if (this.frame) cancelAnimationFrame(this.frame);
      this.render(true);
    }
  }

  function updateControls() {
    const busy = current !== null;
    els.send.disabled = busy || selectedIsLoading();
    els.stop.disabled = !busy;
    els.conversation.setAttribute("aria-busy", busy ? "true" : "false");
    for (const button of els.conversation.querySelectorAll("button.needs-idle")) {
      button.disabled = busy;
    }
    // Regenerate: on the last answer only, when it is the last message.
    const last = views[views.length - 1];
    for (const view of views) {
      if (view.regenerate) view.regenerate.hidden = view !== last;
    }
  }

  // Handles one SSE payload; returns "done" or null (keep reading).
  function handlePayload(turn, data) {
    if (data === "[DONE]") return "done";
    let event;
    try {
      event = JSON.parse(data);
    } catch (_) {
      throw new ProblemError("The server sent an event that is not JSON; the answer stopped.");
    }
    const inBand = errorMessageOf(event);
    if (inBand !== null) {
      throw new InBandError(`The answer stopped with an error: ${inBand}`);
    }
    if (event.usage) turn.usage = event.usage;
    for (const choice of event.choices || []) {
      const content = choice.delta && choice.delta.content;
      if (typeof content === "string" && content) turn.receive(content);
      if (choice.finish_reason) turn.finishReason = choice.finish_reason;
    }
    return null;
  }

  // After [DONE] the server ends the body at once: read that end in the background (the
  // answer is already final), so that the connection closes cleanly and is not counted as a
  // client leaving early.
  function drain(reader) {
    (async () => {
      try {
        while (!(await reader.read()).done);
      } catch (_) {
        // nothing to do: the answer is complete
      }
    })();
  }

  function requestBody(model) {
    const messages = [];
    if (els.system.value.trim()) messages.push({ role: "system", content: els.system.value });
    for (const m of chat.messages) messages.push({ role: m.role, content: m.content });
    const body = { model, messages, stream: true, stream_options: { include_usage: true } };
    const maxTokens = parseInt(els.maxTokens.value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const temperature = numberOf(els.temperature, parseFloat);
    if (temperature !== undefined) body.temperature = temperature;
    const topP = numberOf(els.topP, parseFloat);
    if (topP !== undefined) body.top_p = topP;
    return body;
  }

  // Checks that a message can go now; says why not otherwise.
  function canSend() {
    if (current) return false;
    if (!els.model.value) {
      showError("No model to send to: the model list could not be loaded.");
      return false;
    }
    if (selectedIsLoading()) {
      setStatus(`${loadingText()} Send is enabled once it is ready.`);
      return false;
    }
    return true;
  }

  function send() {
    const prompt = els.message.value.trim();
    if (!prompt || !canSend()) return;
    els.message.value = "";
    const message = { role: "user", content: prompt };
    chat.messages.push(message);
    views.push(makeView(message));
    stream(true);
  }

  function regenerateLast() {
    const last = chat.messages[chat.messages.length - 1];
    if (!last || last.role !== "assistant" || !canSend()) return;
    chat.messages.pop();
    removeView(views.pop());
    stream(false);
  }

  // Edit a message in place: Enter (or "Save and send") sends it again, dropping what came
  // after it; Esc (or Cancel) leaves it as it was.
  function startEdit(view) {
    if (current || view.article.classList.contains("editing")) return;
    const index = views.indexOf(view);
    if (index < 0) return;
    view.article.classList.add("editing");
    const form = element("form", "edit");
    const id = `edit-${Date.now().toString(36)}`;
    const label = element("label", "visually-hidden", "Edited message");
    label.htmlFor = id;
    const box = element("textarea");
    box.id = id;
    box.rows = Math.min(Math.max(view.message.content.split("\n").length, 2), 10);
    box.value = view.message.content;
    const save = element("button", "small", "Save and send");
    save.type = "submit";
    const cancel = element("button", "secondary small", "Cancel");
    cancel.type = "button";
    const buttons = element("div", "edit-buttons");
    buttons.append(save, cancel);
    form.append(label, box, buttons);
    view.body.hidden = true;
    view.body.after(form);
    const close = () => {
      form.remove();
      view.body.hidden = false;
      view.article.classList.remove("editing");
    };
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const text = box.value.trim();
      if (!text || !canSend()) return;
      const at = views.indexOf(view);
      close();
      if (at < 0) return;
      for (const dropped of views.splice(at)) removeView(dropped);
      chat.messages.splice(at);
      const message = { role: "user", content: text };
      chat.messages.push(message);
      views.push(makeView(message));
      stream(true);
    });
    cancel.addEventListener("click", close);
    box.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        form.requestSubmit();
      } else if (event.key === "Escape") {
        event.preventDefault();
        event.stopPropagation();
        close();
        view.article.querySelector("button.needs-idle").focus();
      }
    });
    box.focus();
    box.setSelectionRange(box.value.length, box.value.length);
  }

  // Streams an answer to the conversation as it stands (its last message is the user's).
  async function stream(fresh) {
    const model = els.model.value;
    clearError();
    storageSet(STORAGE_MODEL, model);
    const body = requestBody(model);
    const turn = new Turn(chat, model, fresh);
    current = turn;
    window.sluiceChat.lastTurn = turn;
    updateControls();
    setStatus("Waiting for the first token…");
    follower.jump(); // a new question: follow its answer

    let outcome = "ended"; // done | stopped | failed | ended (closed without [DONE])
    let failure = null;
    let phase = "connect";
    let reader = null;
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: headers(true),
        body: JSON.stringify(body),
        signal: turn.controller.signal,
        cache: "no-store",
      });
      if (!response.ok) throw await httpProblem(response, model);
      phase = "stream";
      reader = response.body.getReader();
      const decoder = new TextDecoder("utf-8");
      const parser = new SSEParser();
      read: for (;;) {
        const { value, done } = await reader.read();
        const text = done ? decoder.decode() : decoder.decode(value, { stream: true });
        for (const data of parser.push(text)) {
          if (handlePayload(turn, data) === "done") {
            outcome = "done";
            break read;
          }
        }
        if (done) break;
      }
      if (outcome === "done") drain(reader);
    } catch (error) {
      if (turn.controller.signal.aborted) {
        outcome = "stopped";
      } else {
        outcome = "failed";
        failure = describeFailure(error, phase);
        if (error instanceof ProblemError && error.code === "model_loading") {
          checkHealth().then(() => {
            drawLoading();
            watchHealth();
          });
        }
        // After an error event the server ends the stream: read that end. After anything
        // else the rest of the stream is of no use: close the connection now.
        if (error instanceof InBandError && reader) drain(reader);
        else turn.controller.abort();
      }
    }
    finish(turn, outcome, failure);
  }

  function finish(turn, outcome, failure) {
    turn.flush();
    current = null;
    const target = turn.chat;
    const shown = target === chat && !turn.discarded;
    const view = turn.view;
    view.article.classList.remove("streaming");
    const stats = turn.firstAt === null ? "" : turn.stats();
    let status;
    let meta;
    let said;
    if (outcome === "done") {
      status = turn.finishReason === "length" ? "length" : "done";
      meta = stats || "No text.";
      said = status === "length" ? `Done, cut off at max tokens. ${stats}` : `Done. ${stats}`;
    } else if (outcome === "stopped") {
      status = "stopped";
      meta = stats ? `Stopped · ${stats}` : "Stopped before the first token.";
      said = `Stopped. ${stats}`;
    } else {
      if (outcome === "ended") failure = "The stream ended before the answer was complete.";
      status = "failed";
      meta = stats ? `Interrupted · ${stats}` : "No answer.";
      said = "Failed.";
    }
    if (turn.text || outcome === "done") {
      // Kept in the conversation even when cut short: the model sees what the user saw.
      const message = { role: "assistant", content: turn.text, model: turn.model, meta, status };
      target.messages.push(message);
      view.message = message;
      setMeta(view, status, meta);
      if (shown) views.push(view);
    } else {
      // Nothing came back: take the answer out; a new message goes back to the composer.
      removeView(view);
      if (turn.fresh) {
        const taken = target.messages.pop();
        if (shown) {
          removeView(views.pop());
          if (!els.message.value) els.message.value = taken.content;
        }
      }
    }
    if (!turn.discarded) saveChat(target);
    if (shown) {
      if (!views.length) els.empty.hidden = false;
      setStatus(said);
      if (status === "failed") showError(failure);
      storageSet(STORAGE_CURRENT, target.id);
    } else if (view.article.isConnected) {
      removeView(view);
    }
    updateControls();
    drawChatList();
    follower.pin();
    if (shown) els.message.focus();
    turn.resolveFinished();
  }

  function stop() {
    if (current) current.controller.abort();
  }

  // A reload or a closed tab in the middle of an answer: keep what arrived.
  function keepPartial() {
    const turn = current;
    if (!turn || turn.discarded || !turn.text) return;
    const stats = turn.firstAt === null ? "" : turn.stats();
    const partial = {
      role: "assistant",
      content: turn.text,
      model: turn.model,
      meta: `Stopped by a reload · ${stats}`,
      status: "stopped",
    };
    saveChat({ ...turn.chat, messages: [...turn.chat.messages, partial] });
    storageSet(STORAGE_CURRENT, turn.chat.id);
  }

  // ------------------------------------------------------------------ wiring

  els.form.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  els.message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape") return;
    if (current) {
      event.preventDefault();
      stop();
    } else if (document.body.classList.contains("drawer-open")) {
      setDrawer(false);
    }
  });
  els.stop.addEventListener("click", stop);
  els.newChat.addEventListener("click", newChat);
  els.jump.addEventListener("click", () => {
    follower.jump();
    els.message.focus({ preventScroll: true });
  });
  els.conversation.addEventListener("scroll", () => follower.onScroll(), { passive: true });
  els.conversation.addEventListener(
    "wheel",
    (event) => {
      if (event.deltaY < 0 && els.conversation.scrollTop > 0) follower.follow = false;
    },
    { passive: true },
  );
  els.conversation.addEventListener("click", (event) => {
    const button = event.target.closest("button.copy");
    if (!button) return;
    const article = button.closest("article");
    const view = views.find((v) => v.article === article);
    if (button.classList.contains("copy-code")) {
      const pre = button.closest(".code-block").querySelector("pre");
      copyFrom(button, pre.textContent);
    } else if (view) {
      copyFrom(button, view.message.content);
    } else if (current && current.view.article === article) {
      copyFrom(button, current.text);
    }
  });
  els.apiKey.value = storageGet(STORAGE_KEY);
  els.apiKey.addEventListener("change", () => {
    storageSet(STORAGE_KEY, els.apiKey.value.trim());
    loadModels();
  });
  els.model.addEventListener("change", () => {
    storageSet(STORAGE_MODEL, els.model.value);
    drawLoading();
  });
  for (const input of [els.maxTokens, els.temperature, els.topP, els.system]) {
    input.addEventListener("input", saveSettings);
  }
  els.system.addEventListener("input", fitSystemPrompt);
  els.settingsToggle.addEventListener("click", () => {
    setSettingsOpen(els.settings.hidden, true);
  });
  els.chatsToggle.addEventListener("click", () => {
    setDrawer(!document.body.classList.contains("drawer-open"));
  });
  $("close-chats").addEventListener("click", () => setDrawer(false));
  document.addEventListener("click", (event) => {
    // A click beside the open drawer (on the dimmed page) closes it.
    if (event.target === document.body && document.body.classList.contains("drawer-open")) {
      setDrawer(false);
    }
  });
  els.theme.addEventListener("click", toggleTheme);
  systemDark.addEventListener("change", applyTheme);
  window.addEventListener("pagehide", keepPartial);
  // Another tab changed the stored chats or the theme.
  window.addEventListener("storage", (event) => {
    if (event.key === STORAGE_THEME || event.key === null) applyTheme();
    if (event.key !== null && !event.key.startsWith(CHAT_PREFIX)) return;
    drawChatList();
    if (!current && (event.key === null || event.key === CHAT_PREFIX + chat.id)) {
      const fresh = readChat(chat.id);
      if (fresh) {
        chat = fresh;
        drawChat();
      } else if (chat.messages.length) {
        newChat();
      }
    }
  });

  applyTheme();
  loadSettings();
  const panel = storageGet(STORAGE_PANEL);
  setSettingsOpen(panel ? panel === "1" : window.matchMedia("(min-width: 700px)").matches, false);
  drawChat();
  drawChatList();

  // For tests and the curious: the parser, the renderer, and the last turn's counters.
  window.sluiceChat = {
    SSEParser,
    retryAfterSeconds,
    sanitize: Markdown ? Markdown.sanitize : null,
    sanitizeHtml: Markdown ? Markdown.sanitizeHtml : null,
    get history() {
      return chat.messages.map(({ role, content }) => ({ role, content }));
    },
    get chat() {
      return chat;
    },
    follower,
    lastTurn: null,
    ready: null,
  };
  window.sluiceChat.ready = start();
  els.message.focus();
})();
