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

async function loadModels() {
  const select = $("model");
  try {
    const resp = await apiFetch("/v1/models");
    const data = await resp.json();
    select.replaceChildren(...data.data.map((m) => new Option(m.id, m.id)));
    showAudioTab(data.data.some((m) => SPEECH_ARCHITECTURES.includes(m.architecture)));
    $("conn-status").textContent = `Connected · ${data.data.length} model${data.data.length === 1 ? "" : "s"}`;
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

selectTab(location.hash.slice(1) || "chat");
loadModels();
void chat;
void audio;
