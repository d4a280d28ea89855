// The chat (and raw completion) pane: streams from /v1/chat/completions or /v1/completions with the
// OpenAI wire format; Stop aborts the fetch, and the server aborts the request when the client goes.

import { apiFetch, AuthError, live } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { readEvents } from "./sse.js";

const $ = (id) => document.getElementById(id);

/** Parse a JSON textarea; "" means absent. Throws an Error naming the field. */
function jsonField(id, label) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(`${label} is not valid JSON: ${e.message}`);
  }
}

function numberField(id, label, { min, max, integer = false }) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const value = Number(raw);
  if (!Number.isFinite(value) || value < min || (max !== undefined && value > max) ||
      (integer && !Number.isInteger(value))) {
    throw new Error(`${label} must be ${integer ? "an integer" : "a number"} from ${min}` +
                    (max !== undefined ? ` to ${max}` : " up") + ".");
  }
  return value;
}

function formatStats({ ttftMs, tokens, tokensPerS, approx, finish }) {
  const parts = [];
  if (ttftMs !== null) parts.push(`TTFT ${Math.round(ttftMs)} ms`);
  if (tokensPerS !== null) parts.push(`${tokensPerS.toFixed(1)} tok/s`);
  parts.push(`${approx ? "≈" : ""}${tokens} tokens`);
  if (finish) parts.push(finish);
  return parts.join(" · ");
}

export class ChatPane {
  constructor({ getModel, announce }) {
    this.getModel = getModel;
    this.announce = announce; // short status messages for screen readers
    this.history = []; // [{role, content}] of the conversation so far (chat mode)
    this.image = null; // the attached image as a data: URL, sent with the next chat message
    this.controller = null;
    this.transcript = $("transcript");
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    $("message").addEventListener("keydown", (e) => {
      // Enter sends, Shift+Enter is a new line (as in most chat apps).
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.send();
      }
    });
    $("image-file").addEventListener("change", () => this.attachImage($("image-file").files[0]));
    $("image-clear").addEventListener("click", () => this.clearImage());
    $("message").addEventListener("paste", (e) => {
      const item = [...(e.clipboardData ? e.clipboardData.items : [])].find((i) => i.type.startsWith("image/"));
      if (item) {
        e.preventDefault();
        this.attachImage(item.getAsFile());
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("new-chat").addEventListener("click", () => this.clear());
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && this.controller) this.stop();
    });
    document.querySelectorAll('input[name="mode"]').forEach((r) =>
      r.addEventListener("change", () => this.syncMode()));
    this.syncMode();
  }

  get mode() {
    return document.querySelector('input[name="mode"]:checked').value;
  }

  syncMode() {
    const chat = this.mode === "chat";
    $("system-field").hidden = !chat;
    $("message-label").textContent = chat ? "Message" : "Prompt (raw text, no chat template)";
    $("message").placeholder = chat ? "Ask something… (Enter sends, Shift+Enter adds a line)"
                                    : "The text to continue… (Enter sends, Shift+Enter adds a line)";
  }

  clear() {
    if (this.controller) this.stop();
    this.history = [];
    this.clearImage();
    this.transcript.replaceChildren();
    this.announce("Started a new chat.");
    $("message").focus();
  }

  stop() {
    if (this.controller) {
      this.controller.abort();
      this.announce("Stopped.");
    }
  }

  setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    this.transcript.setAttribute("aria-busy", busy ? "true" : "false");
  }

  addMessage(role, label) {
    const article = document.createElement("article");
    article.className = `message ${role}`;
    const head = document.createElement("h3");
    head.className = "who";
    head.textContent = label;
    const body = document.createElement("div");
    body.className = "content";
    const stats = document.createElement("p");
    stats.className = "stats";
    article.append(head, body, stats);
    this.transcript.append(article);
    article.scrollIntoView({ block: "end" });
    return article;
  }

  attachImage(file) {
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => {
      this.image = reader.result;
      $("image-preview").src = this.image;
      $("image-preview").hidden = false;
      $("image-clear").hidden = false;
      this.announce("Image attached.");
    };
    reader.onerror = () => this.showError("The image could not be read.");
    reader.readAsDataURL(file);
  }

  clearImage() {
    this.image = null;
    $("image-file").value = "";
    $("image-preview").removeAttribute("src");
    $("image-preview").hidden = true;
    $("image-clear").hidden = true;
  }

  /** The user turn's content: the text, or OpenAI content parts with the attached image. */
  userContent(text) {
    if (!this.image) return text;
    return [{ type: "text", text }, { type: "image_url", image_url: { url: this.image } }];
  }

  buildBody(text) {
    const body = { model: this.getModel(), stream: true, stream_options: { include_usage: true } };
    const temperature = numberField("temperature", "Temperature", { min: 0, max: 2 });
    const topP = numberField("top-p", "top_p", { min: 0, max: 1 });
    const maxTokens = numberField("max-tokens", "Max tokens", { min: 1, integer: true });
    if (temperature !== undefined) body.temperature = temperature;
    if (topP !== undefined) body.top_p = topP;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    if (this.mode === "chat") {
      const schema = jsonField("json-schema", "JSON schema");
      if (schema !== undefined) {
        body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
      }
      const system = $("system").value.trim();
      body.messages = [...(system ? [{ role: "system", content: system }] : []), ...this.history,
                       { role: "user", content: this.userContent(text) }];
    } else {
      if (this.image) throw new Error("Images are sent in chat mode.");
      body.prompt = text;
    }
    const extra = jsonField("extra-body", "Extra request fields");
    if (extra !== undefined) {
      if (typeof extra !== "object" || Array.isArray(extra) || extra === null) {
        throw new Error("Extra request fields must be a JSON object.");
      }
      Object.assign(body, extra);
    }
    return body;
  }

  async send() {
    if (this.controller) return;
    const input = $("message");
    const text = input.value;
    if (!text.trim()) {
      input.focus();
      return;
    }
    const chat = this.mode === "chat";
    let body;
    try {
      body = this.buildBody(text);
    } catch (e) {
      this.showError(e.message);
      return;
    }
    $("form-error").textContent = "";
    const sentContent = chat ? this.userContent(text) : text;
    if (chat) {
      const user = this.addMessage("user", "You");
      user.querySelector(".content").append(renderMarkdown(text));
      if (this.image) {
        const img = document.createElement("img");
        img.className = "attached";
        img.alt = "Attached image";
        img.src = this.image;
        user.querySelector(".content").append(img);
      }
    }
    const answer = this.addMessage("assistant", chat ? "Assistant" : "Completion");
    const content = answer.querySelector(".content");
    const stats = answer.querySelector(".stats");
    let promptNode = null;
    if (!chat) {
      content.classList.add("raw");
      promptNode = document.createElement("span");
      promptNode.className = "prompt-text";
      promptNode.textContent = text;
    }
    input.value = "";
    this.controller = new AbortController();
    this.setBusy(true);
    stats.textContent = "Waiting for the first token…";

    const t0 = performance.now();
    let tFirst = null;
    let output = "";
    let chunks = 0;
    let usage = null;
    let finish = null;
    let stopped = false;
    let failed = null;
    let pending = false;
    const render = () => {
      pending = false;
      if (chat) {
        content.replaceChildren(renderMarkdown(output));
      } else {
        content.replaceChildren(promptNode, document.createTextNode(output));
      }
    };
    try {
      const resp = await apiFetch(chat ? "/v1/chat/completions" : "/v1/completions",
                                  { method: "POST", body, signal: this.controller.signal });
      for await (const event of readEvents(resp)) {
        if (event.error) throw new Error(event.error.message || "The server reported an error.");
        if (event.id && live.requestId !== event.id) {
          live.requestId = event.id;
          answer.dataset.requestId = event.id;
        }
        if (event.usage) usage = event.usage;
        const choice = event.choices && event.choices[0];
        if (!choice) continue;
        const piece = chat ? choice.delta && choice.delta.content : choice.text;
        if (piece) {
          if (tFirst === null) {
            tFirst = performance.now();
            stats.textContent = ""; // the wait is over; the line under the text gets the summary at the end
          }
          output += piece;
          chunks += 1;
          if (!pending) {
            pending = true;
            requestAnimationFrame(render);
          }
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    } catch (e) {
      if (e.name === "AbortError") stopped = true;
      else failed = e instanceof AuthError ? "This server needs an API key: enter it above." : e.message;
    } finally {
      const tEnd = performance.now();
      render();
      this.controller = null;
      live.requestId = null;
      this.setBusy(false);
      const tokens = usage ? usage.completion_tokens : chunks;
      const decodeS = tFirst !== null ? (tEnd - tFirst) / 1000 : 0;
      const summary = formatStats({
        ttftMs: tFirst !== null ? tFirst - t0 : null,
        tokens,
        // Decode speed: tokens after the first, over the time after the first.
        tokensPerS: tokens > 1 && decodeS > 0 ? (tokens - 1) / decodeS : null,
        approx: !usage,
        finish: stopped ? "stopped" : failed ? "error" : finish,
      });
      stats.textContent = summary;
      answer.dataset.state = stopped ? "stopped" : failed ? "error" : "done";
      if (failed) {
        const err = document.createElement("p");
        err.className = "error";
        err.setAttribute("role", "alert");
        err.textContent = failed;
        answer.querySelector(".content").append(err);
      }
      if (chat && !failed) {
        this.history.push({ role: "user", content: sentContent }, { role: "assistant", content: output });
        this.clearImage();
      } else if (chat && failed) {
        input.value = text; // nothing was answered: give the message back for another try
      }
      this.announce(stopped ? "Answer stopped." : failed ? `Error: ${failed}` : `Answer complete. ${summary}`);
      answer.scrollIntoView({ block: "end" });
      input.focus();
    }
  }

  showError(message) {
    $("form-error").textContent = message;
  }
}
