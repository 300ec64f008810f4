// Sluice chat: a streamed chat client for the proxy's OpenAI-compatible API.
//
// No framework, no build step, no external resource. The answer is read from the SSE stream of
// POST /v1/chat/completions with fetch and a ReadableStream reader; tokens are batched and
// drawn at most once per animation frame, so a fast stream costs one DOM write per frame, not
// one per token. Stop aborts the fetch: the connection closes, and the proxy cancels the work
// (an upstream stream is closed, a local model stops at its next decode step).
"use strict";

(function () {
  const STORAGE_KEY = "sluice.apiKey";
  const STORAGE_MODEL = "sluice.model";
  // The stats line is redrawn at most this often while streaming (the text every frame).
  const STATS_INTERVAL_MS = 100;

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

  class ProblemError extends Error {}

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

  // Reads a failed response and says what went wrong, for a person.
  async function describeHttpError(response) {
    let detail = null;
    let code = null;
    try {
      const text = await response.text();
      try {
        const body = JSON.parse(text);
        detail = errorMessageOf(body);
        code = body && body.error && body.error.code;
      } catch (_) {
        detail = text.trim().slice(0, 300) || null;
      }
    } catch (_) {
      // The body could not be read: the status says enough.
    }
    const status = response.status;
    if (status === 429 || status === 503) {
      const seconds = retryAfterSeconds(response.headers.get("Retry-After"));
      const when = seconds === null ? "in a moment" : `in ${seconds} s`;
      const who =
        code === "rate_limit_exceeded" || code === "concurrency_limit_exceeded"
          ? "Your API key is over its limit"
          : "The model is busy";
      return `${who}, try again ${when}.` + (detail ? ` (${detail})` : "");
    }
    if (status === 401) {
      return (
        "The server needs an API key, or this one is wrong: enter it in the API key field." +
        (detail ? ` (${detail})` : "")
      );
    }
    const reason = detail || response.statusText || "no details";
    return `The server answered ${status}: ${reason}`;
  }

  function describeFailure(error, phase) {
    if (error instanceof ProblemError) return error.message;
    const what = error && error.message ? error.message : String(error);
    if (phase === "connect") {
      return `Could not reach the server (${what}). Is the proxy running?`;
    }
    return `The connection was lost in the middle of the answer (${what}).`;
  }

  // ------------------------------------------------------------------ the page

  const $ = (id) => document.getElementById(id);
  const els = {
    model: $("model"),
    maxTokens: $("max-tokens"),
    apiKey: $("api-key"),
    conversation: $("conversation"),
    empty: $("empty"),
    error: $("error"),
    form: $("composer"),
    message: $("message"),
    status: $("status"),
    send: $("send"),
    stop: $("stop"),
    newChat: $("new-chat"),
  };

  // The messages sent with every request: the whole conversation so far.
  const history = [];
  let current = null; // the turn being streamed, if any

  function storageGet(key) {
    try {
      return window.localStorage.getItem(key) || "";
    } catch (_) {
      return ""; // storage disabled: the page still works, it just forgets
    }
  }

  function storageSet(key, value) {
    try {
      if (value) window.localStorage.setItem(key, value);
      else window.localStorage.removeItem(key);
    } catch (_) {
      // ignored, as above
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

  function nearBottom() {
    const c = els.conversation;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 48;
  }

  function scrollToBottom() {
    els.conversation.scrollTop = els.conversation.scrollHeight;
  }

  function addMessage(role, text, label) {
    els.empty.hidden = true;
    const article = document.createElement("article");
    article.className = `message ${role}`;
    const who = document.createElement("h2");
    who.className = "who";
    who.textContent = label;
    const body = document.createElement("div");
    body.className = "text";
    const node = document.createTextNode(text);
    body.appendChild(node);
    const meta = document.createElement("p");
    meta.className = "meta";
    article.append(who, body, meta);
    els.conversation.appendChild(article);
    scrollToBottom();
    return { article, body, node, meta };
  }

  function formatSeconds(ms) {
    return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
  }

  // ------------------------------------------------------------------ models

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
      els.model.replaceChildren(new Option("(unavailable)", ""));
      showError(`Could not load the model list. ${await describeHttpError(response)}`);
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
    if (!current) clearError();
  }

  // ------------------------------------------------------------------ one turn

  class Turn {
    constructor(model, prompt) {
      this.model = model;
      this.prompt = prompt;
      this.controller = new AbortController();
      this.started = performance.now();
      this.firstAt = null;
      this.lastAt = null;
      this.text = ""; // everything received
      this.pending = ""; // received, not drawn yet
      this.chunks = 0; // content deltas received (about one per token)
      this.usage = null;
      this.frame = 0;
      this.renders = 0;
      this.statsAt = 0;
      this.discarded = false;
      this.user = addMessage("user", prompt, "You");
      this.answer = addMessage("assistant", "", model);
      this.answer.article.classList.add("streaming");
      this.answer.meta.textContent = "Waiting for the first token…";
    }

    receive(content) {
      const now = performance.now();
      if (this.firstAt === null) this.firstAt = now;
      this.lastAt = now;
      this.chunks += 1;
      this.text += content;
      this.pending += content;
      if (!this.frame) this.frame = requestAnimationFrame(() => this.render(false));
    }

    // Draws what arrived since the last frame: one DOM write, however many tokens.
    render(final) {
      this.frame = 0;
      if (this.pending) {
        const stick = nearBottom();
        this.answer.node.appendData(this.pending);
        this.pending = "";
        this.renders += 1;
        if (stick) scrollToBottom();
      }
      const now = performance.now();
      if (final || now - this.statsAt >= STATS_INTERVAL_MS) {
        this.statsAt = now;
        const stats = this.stats();
        this.answer.meta.textContent = stats;
        if (!final) setStatus(`Streaming… ${stats}`);
      }
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

  function setBusy(busy) {
    els.send.disabled = busy;
    els.stop.disabled = !busy;
    els.conversation.setAttribute("aria-busy", busy ? "true" : "false");
  }

  // Handles one SSE payload; returns "done", "error" or null (keep reading).
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

  async function send() {
    const prompt = els.message.value.trim();
    if (current || !prompt) return;
    const model = els.model.value;
    if (!model) {
      showError("No model to send to: the model list could not be loaded.");
      return;
    }
    clearError();
    storageSet(STORAGE_MODEL, model);
    const body = {
      model,
      messages: [...history, { role: "user", content: prompt }],
      stream: true,
      stream_options: { include_usage: true },
    };
    const maxTokens = parseInt(els.maxTokens.value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;

    const turn = new Turn(model, prompt);
    current = turn;
    window.sluiceChat.lastTurn = turn;
    els.message.value = "";
    setBusy(true);
    setStatus("Waiting for the first token…");

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
      if (!response.ok) throw new ProblemError(await describeHttpError(response));
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
    setBusy(false);
    if (turn.discarded) return; // "New chat" while it streamed: the turn is gone already
    const { article, meta } = turn.answer;
    article.classList.remove("streaming");
    const stats = turn.firstAt === null ? "" : turn.stats();
    if (turn.text || outcome === "done") {
      // Kept in the conversation even when cut short: the model sees what the user saw.
      history.push({ role: "user", content: turn.prompt });
      history.push({ role: "assistant", content: turn.text });
    }
    if (outcome === "done") {
      meta.textContent = stats || "No text.";
      setStatus(`Done. ${stats}`);
    } else if (outcome === "stopped") {
      article.classList.add("stopped");
      meta.textContent = stats ? `Stopped · ${stats}` : "Stopped before the first token.";
      setStatus(`Stopped. ${stats}`);
    } else {
      if (outcome === "ended") {
        failure = "The stream ended before the answer was complete.";
      }
      article.classList.add("failed");
      meta.textContent = stats ? `Interrupted · ${stats}` : "No answer.";
      setStatus("Failed.");
      showError(failure);
    }
    if (!turn.text && outcome !== "done") {
      // Nothing came back: take the turn out, and give the draft back to try again.
      turn.user.article.remove();
      article.remove();
      if (!els.message.value) els.message.value = turn.prompt;
      els.empty.hidden = history.length > 0;
    }
    els.message.focus();
  }

  function stop() {
    if (current) current.controller.abort();
  }

  function newChat() {
    if (current) current.discarded = true;
    stop();
    history.length = 0;
    for (const article of els.conversation.querySelectorAll("article")) article.remove();
    els.empty.hidden = false;
    clearError();
    setStatus("");
    els.message.focus();
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
    if (event.key === "Escape" && current) {
      event.preventDefault();
      stop();
    }
  });
  els.stop.addEventListener("click", stop);
  els.newChat.addEventListener("click", newChat);
  els.apiKey.value = storageGet(STORAGE_KEY);
  els.apiKey.addEventListener("change", () => {
    storageSet(STORAGE_KEY, els.apiKey.value.trim());
    loadModels();
  });
  els.model.addEventListener("change", () => storageSet(STORAGE_MODEL, els.model.value));

  // For tests and the curious: the parser, and the last turn's counters.
  window.sluiceChat = { SSEParser, retryAfterSeconds, history, lastTurn: null, ready: null };
  window.sluiceChat.ready = loadModels();
  els.message.focus();
})();
