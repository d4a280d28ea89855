// The audio pane: upload a file or record one (MediaRecorder), then POST it to /v1/audio/transcriptions (or
// /translations) as verbose_json and show the text and its timed segments; a segment's time plays from there.

import { apiFetch, AuthError } from "./api.js";

const $ = (id) => document.getElementById(id);

/** 75.25 -> "01:15.2" (hours only when needed). */
export function clock(seconds) {
  const tenths = Math.max(0, Math.round(seconds * 10));
  const h = Math.floor(tenths / 36000);
  const m = Math.floor((tenths % 36000) / 600);
  const s = (tenths % 600) / 10;
  const mmss = `${String(m).padStart(2, "0")}:${s.toFixed(1).padStart(4, "0")}`;
  return h ? `${h}:${mmss}` : mmss;
}

export class AudioPane {
  constructor({ getModel, announce }) {
    this.getModel = getModel;
    this.announce = announce;
    this.clip = null; // {blob, name} to send
    this.recorder = null;
    this.controller = null;
    $("audio-file").addEventListener("change", () => {
      const file = $("audio-file").files[0];
      if (file) this.setClip(file, file.name);
    });
    $("audio-record").addEventListener("click", () => (this.recorder ? this.stopRecording() : this.record()));
    $("audio-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.transcribe();
    });
    $("audio-cancel").addEventListener("click", () => this.controller && this.controller.abort());
  }

  setClip(blob, name) {
    this.clip = { blob, name };
    const player = $("audio-player");
    if (player.src) URL.revokeObjectURL(player.src);
    player.src = URL.createObjectURL(blob);
    player.hidden = false;
    $("audio-clip").textContent = `${name} · ${(blob.size / 1024).toFixed(1)} KiB`;
    $("audio-submit").disabled = false;
    $("audio-error").textContent = "";
  }

  async record() {
    $("audio-error").textContent = "";
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    } catch (e) {
      $("audio-error").textContent = `No microphone: ${e.message}`;
      return;
    }
    const type = ["audio/webm;codecs=opus", "audio/ogg;codecs=opus", "audio/mp4"].find(
      (t) => window.MediaRecorder && MediaRecorder.isTypeSupported(t)) || "";
    const chunks = [];
    this.recorder = new MediaRecorder(stream, type ? { mimeType: type } : undefined);
    this.recorder.addEventListener("dataavailable", (e) => e.data.size && chunks.push(e.data));
    this.recorder.addEventListener("stop", () => {
      stream.getTracks().forEach((t) => t.stop());
      const mime = this.recorder.mimeType || type || "audio/webm";
      const ext = mime.includes("ogg") ? "ogg" : mime.includes("mp4") ? "m4a" : "webm";
      this.recorder = null;
      $("audio-record").textContent = "Record";
      $("audio-record").setAttribute("aria-pressed", "false");
      this.setClip(new Blob(chunks, { type: mime }), `recording.${ext}`);
      this.announce("Recording stopped.");
    });
    this.recorder.start(250);
    $("audio-record").textContent = "Stop recording";
    $("audio-record").setAttribute("aria-pressed", "true");
    this.announce("Recording.");
  }

  stopRecording() {
    if (this.recorder && this.recorder.state !== "inactive") this.recorder.stop();
  }

  async transcribe() {
    if (!this.clip) return;
    const task = document.querySelector("input[name=audio-task]:checked").value;
    const form = new FormData();
    form.append("file", this.clip.blob, this.clip.name);
    form.append("model", this.getModel());
    form.append("response_format", "verbose_json");
    form.append("timestamp_granularities[]", "segment");
    const language = $("audio-language").value.trim();
    if (language) form.append("language", language);
    const prompt = $("audio-prompt").value.trim();
    if (prompt) form.append("prompt", prompt);
    const path = task === "translate" ? "/v1/audio/translations" : "/v1/audio/transcriptions";
    this.controller = new AbortController();
    $("audio-submit").disabled = true;
    $("audio-cancel").disabled = false;
    $("audio-error").textContent = "";
    $("audio-status").textContent = task === "translate" ? "Translating…" : "Transcribing…";
    $("audio-result").setAttribute("aria-busy", "true");
    const started = performance.now();
    try {
      const resp = await apiFetch(path, { method: "POST", body: form, signal: this.controller.signal });
      const data = await resp.json();
      this.show(data, (performance.now() - started) / 1000);
      this.announce("Transcript ready.");
    } catch (e) {
      $("audio-status").textContent = "";
      // A 401 also opens the key form (api.js); the message says why nothing came back.
      $("audio-error").textContent = e.name === "AbortError" ? "Cancelled." :
        e instanceof AuthError ? "This server needs an API key." : e.message;
    } finally {
      this.controller = null;
      $("audio-submit").disabled = false;
      $("audio-cancel").disabled = true;
      $("audio-result").setAttribute("aria-busy", "false");
    }
  }

  show(data, seconds) {
    $("audio-text").textContent = data.text;
    $("audio-status").textContent = `${data.language} · ${clock(data.duration)} of audio · ` +
      `${data.segments.length} segment${data.segments.length === 1 ? "" : "s"} · ${seconds.toFixed(1)} s`;
    const items = data.segments.map((seg) => {
      const li = document.createElement("li");
      const at = document.createElement("button");
      at.type = "button";
      at.className = "seek secondary";
      at.dataset.start = String(seg.start);
      at.textContent = `${clock(seg.start)} → ${clock(seg.end)}`;
      at.setAttribute("aria-label", `Play from ${clock(seg.start)}`);
      at.addEventListener("click", () => {
        const player = $("audio-player");
        player.currentTime = seg.start;
        player.play().catch(() => {});
      });
      const text = document.createElement("span");
      text.className = "seg-text";
      text.textContent = seg.text.trim();
      li.append(at, " ", text);
      return li;
    });
    $("audio-segments").replaceChildren(...items);
  }
}
