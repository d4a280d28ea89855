// The live KV cache map: polls /v1/kv_cache/snapshot while its tab is shown and draws one cell per block, one map
// per engine when the server runs several (--data-parallel-size).

import { apiFetch, AuthError, isLive } from "./api.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 250;

// Fixed state colours; requests get their own hues (see ownerColour). Checked for contrast against the
// page background in both themes (see style.css).
export const STATE_COLOURS = {
  n: "#1f2937", // null block
  f: "#d1d5db", // free
  c: "#7c8aa5", // cached, free
};
const STATE_NAMES = { n: "reserved (null)", f: "free", c: "cached, free", u: "in use", s: "in use, shared" };

/** A stable colour per request id (same request, same colour across refreshes). */
export function ownerColour(id) {
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619);
  const hue = (h >>> 0) % 360;
  return `hsl(${hue} 75% 45%)`;
}

function decodeRuns(runs, numBlocks) {
  const states = new Array(numBlocks);
  const owners = new Int32Array(numBlocks);
  let i = 0;
  for (const [state, owner, count] of runs) {
    for (let k = 0; k < count; k++, i++) {
      states[i] = state;
      owners[i] = owner;
    }
  }
  return { states, owners };
}

function pct(x) {
  return `${(100 * x).toFixed(1)}%`;
}

/** Engine i's copy of engine 0's section: every id gets "-i", and so do the attributes that refer to ids. */
function cloneSection(template, index) {
  const root = template.cloneNode(true);
  for (const el of [root, ...root.querySelectorAll("*")]) {
    if (el.id) el.id += `-${index}`;
    for (const attr of ["for", "aria-labelledby", "aria-describedby"]) {
      const ids = el.getAttribute(attr);
      if (ids) el.setAttribute(attr, ids.split(/\s+/).map((id) => `${id}-${index}`).join(" "));
    }
  }
  return root;
}

/** The polling, the pause button and one EngineMap per engine. */
export class KvMap {
  constructor() {
    const first = $("kv-engine");
    // Page-wide parts (legend, error) sit in engine 0's section so one engine looks as it always did; the
    // clones for other engines leave them out. Taken before any snapshot fills the section in.
    this.pageWide = [...first.querySelectorAll(".page-wide")];
    this.template = first.cloneNode(true);
    for (const el of this.template.querySelectorAll(".page-wide")) el.remove();
    this.maps = [new EngineMap(first, 0)];
    this.timer = null;
    this.active = false;
    this.paused = false;
    $("kv-pause").addEventListener("click", () => this.togglePause());
    window.addEventListener("resize", () => this.maps.forEach((m) => m.draw()));
    document.addEventListener("visibilitychange", () => this.schedule(0));
  }

  show(active) {
    this.active = active;
    this.schedule(0);
  }

  togglePause() {
    this.paused = !this.paused;
    $("kv-pause").textContent = this.paused ? "Resume" : "Pause";
    $("kv-pause").setAttribute("aria-pressed", String(this.paused));
    this.schedule(0);
  }

  schedule(delay) {
    clearTimeout(this.timer);
    this.timer = null;
    if (this.active && !this.paused && !document.hidden) this.timer = setTimeout(() => this.poll(), delay);
  }

  async poll() {
    try {
      const resp = await apiFetch("/v1/kv_cache/snapshot");
      this.update(await resp.json());
      $("kv-error").textContent = "";
    } catch (e) {
      $("kv-error").textContent = e instanceof AuthError ? "The cache map needs the API key (enter it above)."
                                                         : `Could not read the cache: ${e.message}`;
    }
    this.schedule(POLL_MS);
  }

  update(snap) {
    // Several engines: all of them under `engines` (engine 0 is the top level too). One: the top level only.
    const engines = Array.isArray(snap.engines) && snap.engines.length ? snap.engines : [snap];
    this.setEngineCount(engines.length);
    const changed = engines.map((s, i) => this.maps[i].update(s));
    if (changed.some(Boolean)) {
      $("kv-updated").textContent = new Date(Math.max(...engines.map((s) => s.time)) * 1000).toLocaleTimeString();
    }
  }

  setEngineCount(n) {
    if (n === this.maps.length) return;
    const multi = n > 1;
    while (this.maps.length > n) this.maps.pop().root.remove();
    while (this.maps.length < n) {
      const root = cloneSection(this.template, this.maps.length);
      $("kv-engines").append(root);
      this.maps.push(new EngineMap(root, this.maps.length));
    }
    $("kv-view").classList.toggle("multi", multi);
    // With several maps the legend and the error line belong to none of them: above all the maps.
    const anchor = multi ? $("kv-engines") : this.maps[0].el("kv-canvas").parentElement;
    for (const el of this.pageWide) anchor.before(el);
    for (const map of this.maps) map.setLabelled(multi);
  }
}

/** One engine's map: its counters, canvas, tooltip, keyboard inspector and owners table, inside `root`. */
class EngineMap {
  constructor(root, index) {
    this.root = root;
    this.index = index;
    this.suffix = index ? `-${index}` : ""; // see cloneSection
    this.labelled = false;
    this.canvas = this.el("kv-canvas");
    this.ctx = this.canvas.getContext("2d");
    this.snapshot = null;
    this.decoded = null;
    this.prev = null; // the previous snapshot's counters, for rates over the last interval
    this.cursor = 0; // the block the keyboard inspector points at
    this.cell = 8;
    this.cols = 1;
    this.canvas.addEventListener("mousemove", (e) => this.inspectAt(e));
    this.canvas.addEventListener("mouseleave", () => this.hideTip());
    this.canvas.addEventListener("keydown", (e) => this.onKey(e));
    this.canvas.addEventListener("focus", () => this.inspect(this.cursor, false));
    this.canvas.addEventListener("blur", () => this.hideTip());
  }

  /** This engine's element of engine 0's id `id` (found in `root`, so it works before `root` is in the page). */
  el(id) {
    return this.root.querySelector(`#${id}${this.suffix}`);
  }

  /** Several engines: name this one on its section, map, owners table and inspector; one engine: no names. */
  setLabelled(labelled) {
    this.labelled = labelled;
    const label = this.el("kv-engine-label");
    label.textContent = `engine ${this.index}`;
    label.hidden = !labelled;
    if (labelled) this.root.setAttribute("aria-labelledby", label.id);
    else this.root.removeAttribute("aria-labelledby");
    this.el("kv-owners-caption").textContent = labelled ? `Requests holding blocks on engine ${this.index}`
                                                        : "Requests holding blocks";
    this.draw(); // the map's aria-label names the engine
  }

  /** A new snapshot of this engine; false if it is the one already shown (each engine counts its own seq). */
  update(snap) {
    if (this.snapshot && snap.seq === this.snapshot.seq) return false; // nothing new
    this.prev = this.snapshot;
    this.snapshot = snap;
    this.decoded = decodeRuns(snap.runs, snap.num_blocks);
    this.draw();
    this.renderCounters();
    this.renderOwners();
    return true;
  }

  layout() {
    const n = this.snapshot.num_blocks;
    const width = Math.max(this.canvas.parentElement.clientWidth, 200);
    // Cells as large as fit in about 60% of the viewport's height, between 3 and 18 px.
    const budget = width * Math.max(window.innerHeight * 0.6, 240);
    const cell = Math.max(3, Math.min(18, Math.floor(Math.sqrt(budget / n))));
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.ceil(n / cols);
    return { cell, cols, rows, width: cols * cell, height: rows * cell };
  }

  colourOf(i) {
    const state = this.decoded.states[i];
    if (state === "u" || state === "s") {
      const owner = this.snapshot.owners[this.decoded.owners[i]];
      return owner ? ownerColour(owner.id) : "#000";
    }
    return STATE_COLOURS[state] || "#000";
  }

  draw() {
    if (!this.snapshot) return;
    const { cell, cols, width, height } = this.layout();
    const dpr = window.devicePixelRatio || 1;
    const canvas = this.canvas;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
    canvas.dataset.cell = String(cell);
    canvas.dataset.cols = String(cols);
    const ctx = this.ctx;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const gap = cell >= 6 ? 1 : 0;
    for (let i = 0; i < this.snapshot.num_blocks; i++) {
      const x = (i % cols) * cell;
      const y = Math.floor(i / cols) * cell;
      ctx.fillStyle = this.colourOf(i);
      ctx.fillRect(x, y, cell - gap, cell - gap);
      const state = this.decoded.states[i];
      if (state === "s" && cell >= 6) {
        // Shared blocks: a light centre dot (prefix-cache hits held by several requests).
        ctx.fillStyle = "#ffffff";
        const d = Math.max(2, Math.floor(cell / 3));
        ctx.fillRect(x + (cell - gap - d) / 2, y + (cell - gap - d) / 2, d, d);
      }
      if ((state === "u" || state === "s") && cell >= 8) {
        const owner = this.snapshot.owners[this.decoded.owners[i]];
        if (owner && isLive(owner.id)) {
          ctx.fillStyle = "#000000"; // this tab's request: a dark corner mark
          ctx.fillRect(x, y, 3, 3);
        }
      }
    }
    this.cell = cell;
    this.cols = cols;
    const c = this.snapshot.counts;
    const of = this.labelled ? `engine ${this.index}, ` : "";
    canvas.setAttribute("aria-label",
      `KV cache map of ${of}${this.snapshot.num_blocks} blocks: ${c.used} in use, ${c.shared} shared, ` +
      `${c.cached} cached and free, ${c.free} free. Arrow keys inspect blocks.`);
  }

  renderCounters() {
    const s = this.snapshot;
    const p = this.prev;
    const set = (id, text) => (this.el(id).textContent = text);
    set("kv-usage", `${pct(s.kv_cache_usage)} (${s.counts.used + s.counts.shared} of ${s.num_blocks - 1} blocks)`);
    set("kv-blocks", `${s.counts.used} used · ${s.counts.shared} shared · ${s.counts.cached} cached · ` +
                     `${s.counts.free} free`);
    set("kv-geometry", `${s.num_blocks} blocks × ${s.block_size} tokens`);
    let hit = `${pct(s.prefix_cache.hit_rate)} overall`;
    if (p && s.prefix_cache.queries > p.prefix_cache.queries) {
      const recent = (s.prefix_cache.hits - p.prefix_cache.hits) / (s.prefix_cache.queries - p.prefix_cache.queries);
      hit += ` · ${pct(recent)} recent`;
    }
    set("kv-hit-rate", hit);
    set("kv-running", String(s.scheduler.running));
    set("kv-waiting", String(s.scheduler.waiting));
    set("kv-preemptions", String(s.scheduler.preemptions));
    const st = s.step_time_ms;
    let steps = st.num_steps ? `${st.last.toFixed(1)} ms last · ${st.mean.toFixed(1)} ms mean · ` +
                               `${st.max.toFixed(1)} ms max`
                             : st.last > 0 ? `idle (last step ${st.last.toFixed(1)} ms)` : "idle";
    if (st.num_steps && p && s.time > p.time && s.scheduler.steps > p.scheduler.steps) {
      steps += ` · ${((s.scheduler.steps - p.scheduler.steps) / (s.time - p.time)).toFixed(1)} steps/s`;
    }
    set("kv-step-time", steps);
    // For scripts and tests: each section carries its engine's counts, and #kv-view engine 0's (the top level,
    // as in the endpoint's answer).
    for (const root of this.index ? [this.root] : [this.root, $("kv-view")]) {
      root.dataset.engine = String(this.index);
      root.dataset.seq = String(s.seq);
      root.dataset.free = String(s.counts.free);
      root.dataset.cached = String(s.counts.cached);
      root.dataset.used = String(s.counts.used);
      root.dataset.shared = String(s.counts.shared);
      root.dataset.owners = s.owners.map((o) => o.id).join(" ");
    }
  }

  renderOwners() {
    const body = this.el("kv-owners");
    const rows = this.snapshot.owners.map((o) => {
      const tr = document.createElement("tr");
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = ownerColour(o.id);
      const idCell = document.createElement("td");
      idCell.append(swatch, o.id + (isLive(o.id) ? " (this tab)" : ""));
      tr.append(idCell);
      for (const v of [o.status, o.num_blocks, o.num_tokens]) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.append(td);
      }
      return tr;
    });
    if (!rows.length) {
      const tr = document.createElement("tr");
      const td = document.createElement("td");
      td.colSpan = 4;
      td.textContent = "No request holds blocks right now.";
      tr.append(td);
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }

  describe(i) {
    const state = this.decoded.states[i];
    let text = `Block ${i}${this.labelled ? ` of engine ${this.index}` : ""}: ${STATE_NAMES[state] || state}`;
    if (state === "u" || state === "s") {
      const owner = this.snapshot.owners[this.decoded.owners[i]];
      if (owner) text += ` by ${owner.id} (${owner.status})`;
    }
    return text;
  }

  inspect(i, fromMouse, event) {
    if (!this.snapshot || i < 0 || i >= this.snapshot.num_blocks) return this.hideTip();
    this.cursor = i;
    const tip = this.el("kv-tip");
    tip.textContent = this.describe(i);
    tip.hidden = false;
    const x = (i % this.cols) * this.cell;
    const y = Math.floor(i / this.cols) * this.cell;
    tip.style.left = `${fromMouse && event ? event.offsetX + 12 : x + this.cell + 4}px`;
    tip.style.top = `${fromMouse && event ? event.offsetY + 12 : y + this.cell + 4}px`;
    if (!fromMouse) this.el("kv-inspector").textContent = tip.textContent; // announced (aria-live)
  }

  inspectAt(e) {
    if (!this.snapshot) return;
    const col = Math.floor(e.offsetX / this.cell);
    const row = Math.floor(e.offsetY / this.cell);
    if (col >= this.cols) return this.hideTip();
    this.inspect(row * this.cols + col, true, e);
  }

  hideTip() {
    this.el("kv-tip").hidden = true;
  }

  onKey(e) {
    if (!this.snapshot) return;
    const moves = { ArrowLeft: -1, ArrowRight: 1, ArrowUp: -this.cols, ArrowDown: this.cols,
                    Home: -this.cursor, End: this.snapshot.num_blocks - 1 - this.cursor };
    if (!(e.key in moves)) return;
    e.preventDefault();
    const next = Math.min(Math.max(this.cursor + moves[e.key], 0), this.snapshot.num_blocks - 1);
    this.inspect(next, false);
  }
}
