// Start-up: API key, model list, tabs (Chat / Audio / KV cache, also reachable as #chat, #audio and #kv).

import { apiFetch, AuthError, getApiKey, onAuthRequired, setApiKey } from "./api.js";
import { AudioPane } from "./audio.js";
import { ChatPane } from "./chat.js";
import { KvMap } from "./kvmap.js";

const $ = (id) => document.getElementById(id);

function announce(text) {
  const region = $("announcer");
  region.textContent = "";
  // A fresh text node after a tick, so the same message is announced twice if repeated.
  setTimeout(() => (region.textContent = text), 50);
}

function showKeyForm(message) {
  $("key-form").hidden = false;
  $("key-form").classList.remove("saved");
  $("key-status").textContent = message;
}

const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

// Base models first; LoRA adapters (a card with a parent: --lora-modules or loaded at run time) in their own
// group, so that picking one sends its name as the request's model. The choice survives a refresh.
function fillModelSelect(select, cards) {
  const previous = select.value;
  const bases = cards.filter((m) => !m.parent);
  const adapters = cards.filter((m) => m.parent);
  const listed = JSON.stringify(cards.map((m) => [m.id, m.parent]));
  // Unchanged: leave the options alone (rebuilding them would close a list the user just opened).
  if (select.dataset.listed === listed) return { bases: bases.length, adapters: adapters.length };
  select.dataset.listed = listed;
  const options = bases.map((m) => new Option(m.id, m.id));
  if (adapters.length) {
    const group = document.createElement("optgroup");
    group.label = "LoRA adapters";
    group.append(...adapters.map((m) => new Option(`${m.id} (adapter of ${m.parent})`, m.id)));
    options.push(group);
  }
  select.replaceChildren(...options);
  if (cards.some((m) => m.id === previous)) select.value = previous;
  return { bases: bases.length, adapters: adapters.length };
}

async function loadModels() {
  const select = $("model");
  try {
    const resp = await apiFetch("/v1/models");
    const data = await resp.json();
    const counts = fillModelSelect(select, data.data);
    showAudioTab(data.data.some((m) => SPEECH_ARCHITECTURES.includes(m.architecture)));
    $("conn-status").textContent = `Connected · ${plural(counts.bases, "model")}` +
      (counts.adapters ? `, ${plural(counts.adapters, "adapter")}` : "");
    if (getApiKey()) {
      // Connected with a key: keep only "Forget" (the key stays in this tab's session storage).
      $("key-form").classList.add("saved");
      $("key-status").textContent = "API key saved for this tab.";
    } else {
      $("key-form").hidden = true;
    }
    return true;
  } catch (e) {
    $("conn-status").textContent = e instanceof AuthError ? "API key needed" : `Not connected: ${e.message}`;
    return false;
  }
}

const TABS = ["chat", "audio", "kv"];
// The audio tab is shown only when the server runs a speech-to-text model (/v1/models names its architecture).
const SPEECH_ARCHITECTURES = ["WhisperForConditionalGeneration"];
const requestedTab = location.hash.slice(1);

const shownTabs = () => TABS.filter((tab) => !$(`tab-${tab}`).hidden);

function showAudioTab(speech) {
  $("tab-audio").hidden = !speech;
  const current = TABS.find((tab) => $(`tab-${tab}`).getAttribute("aria-selected") === "true");
  if (speech && (requestedTab === "audio" || !requestedTab)) selectTab("audio");
  else if (!speech && current === "audio") selectTab("chat");
}

function selectTab(name, { focus = false } = {}) {
  if (!shownTabs().includes(name)) name = "chat";
  for (const tab of TABS) {
    const button = $(`tab-${tab}`);
    const selected = tab === name;
    button.setAttribute("aria-selected", String(selected));
    button.tabIndex = selected ? 0 : -1;
    $(`panel-${tab}`).hidden = !selected;
  }
  if (focus) $(`tab-${name}`).focus();
  kv.show(name === "kv");
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
}

const chat = new ChatPane({ getModel: () => $("model").value, announce });
const kv = new KvMap();
const audio = new AudioPane({ getModel: () => $("model").value, announce });

for (const tab of TABS) {
  $(`tab-${tab}`).addEventListener("click", () => selectTab(tab));
  // Arrow keys move between tabs (the WAI-ARIA tabs pattern).
  $(`tab-${tab}`).addEventListener("keydown", (e) => {
    const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
    if (step) {
      e.preventDefault();
      const shown = shownTabs();
      selectTab(shown[(shown.indexOf(tab) + step + shown.length) % shown.length], { focus: true });
    }
  });
}
window.addEventListener("hashchange", () => selectTab(location.hash.slice(1)));

onAuthRequired(() => showKeyForm(getApiKey() ? "The saved API key was rejected; enter the right one."
                                             : "This server needs an API key."));
$("key-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  setApiKey($("api-key").value.trim());
  $("api-key").value = "";
  if (await loadModels()) {
    announce("API key accepted.");
    $("message").focus(); // the key field is hidden now
  }
});
$("key-forget").addEventListener("click", () => {
  setApiKey("");
  $("key-status").textContent = "Forgot the API key.";
  loadModels();
});

// Adapters loaded or unloaded at run time (/v1/load_lora_adapter) show up when the list gets the focus again.
$("model").addEventListener("focus", () => loadModels());

selectTab(location.hash.slice(1) || "chat");
loadModels();
void chat;
void audio;
