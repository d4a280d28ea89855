// The server's public API, with the API key kept in this tab's sessionStorage (never in localStorage or
// cookies: it is gone when the tab closes, and no other site can send it).

const KEY_NAME = "pagedllm.apiKey";
let memoryKey = ""; // fallback when sessionStorage is unavailable

export class AuthError extends Error {}

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

export function getApiKey() {
  try {
    return sessionStorage.getItem(KEY_NAME) || "";
  } catch {
    return "";
  }
}

export function setApiKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY_NAME, key);
    else sessionStorage.removeItem(KEY_NAME);
  } catch {
    // Storage disabled: the key then lives only until the page reloads.
  }
  memoryKey = key || "";
}

function authHeaders() {
  const key = getApiKey() || memoryKey;
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Listeners told when the server answers 401 (the page then asks for a key).
const authListeners = new Set();
export function onAuthRequired(fn) {
  authListeners.add(fn);
}

/** fetch() against this server with the key; throws AuthError on 401 and ApiError on other failures. */
export async function apiFetch(path, { method = "GET", body, signal } = {}) {
  const headers = { ...authHeaders() };
  // FormData (an upload) goes as multipart, with the boundary the browser sets; anything else as JSON.
  const form = body instanceof FormData;
  if (body !== undefined && !form) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : form ? body : JSON.stringify(body),
    signal,
    cache: "no-store",
  });
  if (resp.status === 401) {
    authListeners.forEach((fn) => fn());
    throw new AuthError("This server needs an API key.");
  }
  if (!resp.ok) {
    let message = `HTTP ${resp.status}`;
    try {
      const data = await resp.json();
      if (data && data.error && data.error.message) message = data.error.message;
    } catch {
      // not JSON: keep the status line
    }
    throw new ApiError(message, resp.status);
  }
  return resp;
}

/** Shared between the chat and the cache map: the response id of the answer being streamed. */
export const live = { requestId: null };

/** Whether an engine request id belongs to the streamed answer: completions add "-<prompt index>",
 * and n > 1 children get "<index>_" in front. */
export function isLive(engineRequestId) {
  const mine = live.requestId;
  return !!mine && (engineRequestId === mine || engineRequestId.startsWith(`${mine}-`) ||
                    engineRequestId.endsWith(`_${mine}`));
}
