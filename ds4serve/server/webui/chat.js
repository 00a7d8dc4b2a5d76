// The page's API client: JSON calls and streamed chat completions (SSE over fetch).
//
// Every call carries the user's key (when one is set) and nothing else: the page holds no secret of
// its own. Errors become ApiError with the server's OpenAI error message, status and code, so the
// page can show exactly what the server said (400 validation, 401 key, 503 queue full ...).
"use strict";

(function (global) {
  class ApiError extends Error {
    constructor(status, message, code, retryAfter) {
      super(message);
      this.name = "ApiError";
      this.status = status;      // HTTP status; 0 for a network failure, 200 for an error inside a stream
      this.code = code || null;  // the OpenAI error code (e.g. "server_overloaded", "invalid_api_key")
      this.retryAfter = retryAfter || null;
    }
  }

  function headers(key, json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  async function errorOf(resp) {
    // the OpenAI error body when there is one, else the status line
    let message = resp.status + " " + (resp.statusText || "error");
    let code = null;
    try {
      const body = await resp.json();
      if (body && body.error) {
        message = String(body.error.message || message);
        code = body.error.code || body.error.type || null;
      }
    } catch (_) { /* not JSON: keep the status line */ }
    return new ApiError(resp.status, message, code, resp.headers.get("Retry-After"));
  }

  async function send(path, init) {
    try {
      return await fetch(path, init);
    } catch (exc) {
      if (exc && exc.name === "AbortError") throw exc;
      throw new ApiError(0, "could not reach the server (" + (exc && exc.message || exc) + ")", "network");
    }
  }

  /** GET a JSON API path with the key. */
  async function getJSON(path, key) {
    const resp = await send(path, { headers: headers(key, false), cache: "no-store" });
    if (!resp.ok) throw await errorOf(resp);
    return resp.json();
  }

  /** Parse one SSE event block into its data payload (null for comments / keep-alives). */
  function eventData(block) {
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    return data.length ? data.join("\n") : null;
  }

  /**
   * POST a chat completion with stream: true; call onChunk(chunk) for every JSON chunk.
   * Resolves when the stream ends ([DONE]); rejects with ApiError (or AbortError when stopped).
   */
  async function streamChat(body, key, signal, onChunk) {
    const resp = await send("/v1/chat/completions", {
      method: "POST", headers: headers(key, true), body: JSON.stringify(body), signal,
    });
    if (!resp.ok) throw await errorOf(resp);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const data = eventData(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
        if (data === null) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(200, String(chunk.error.message), chunk.error.code);
        onChunk(chunk);
      }
    }
    throw new ApiError(200, "the stream ended without [DONE] (the server closed it)", "incomplete");
  }

  global.ds4chat = Object.freeze({ ApiError, getJSON, streamChat });
})(window);
