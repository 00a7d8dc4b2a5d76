// One assistant reply as it streams: reasoning (collapsed), answer (markdown), timing and errors.
//
// The bubble's data-state says where it stands ("waiting", "streaming", "done", "stopped", "error"),
// which the page's tests wait on. TTFT is request sent -> first reasoning or answer text; tokens/s is
// the decode rate after the first token (tokens from the server's usage when it sent one).
"use strict";

(function (global) {
  const RENDER_EVERY_MS = 40;

  function part(tag, cls, parent) {
    const node = document.createElement(tag);
    node.className = cls;
    parent.appendChild(node);
    return node;
  }

  class Reply {
    constructor(node, onUpdate) {
      this.node = node;
      this.onUpdate = onUpdate || (() => {});
      this.details = part("details", "reasoning", node);
      part("summary", "", this.details).textContent = "Reasoning";
      this.reasoningBox = part("div", "reasoning-text", this.details);
      this.details.hidden = true;
      this.body = part("div", "content", node);
      this.stats = part("div", "stats", node);
      this.errorBox = part("div", "error", node);
      this.errorBox.setAttribute("role", "alert");
      this.errorBox.hidden = true;
      this.node.dataset.state = "waiting";
      this.start();
    }

    /** (Re)start the clock and the text: called for each attempt (a retry after the key prompt). */
    start() {
      this.t0 = performance.now();
      this.tFirst = null;
      this.content = "";
      this.reasoning = "";
      this.pieces = 0;
      this.usage = null;
      this.finishReason = null;
      this.timer = null;
    }

    chunk(c) {
      if (c.usage) this.usage = c.usage;
      const choice = c.choices && c.choices[0];
      if (!choice) return;
      const d = choice.delta || {};
      const reasoning = d.reasoning_content != null ? d.reasoning_content : d.reasoning;
      if (reasoning || d.content) {
        if (this.tFirst === null) this.tFirst = performance.now();
        this.tLast = performance.now();
        this.pieces++;
      }
      if (reasoning) this.reasoning += reasoning;
      if (d.content) this.content += d.content;
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
      this.node.dataset.state = "streaming";
      if (this.timer === null) this.timer = setTimeout(() => { this.timer = null; this.render(); }, RENDER_EVERY_MS);
    }

    render() {
      if (this.reasoning) {
        this.details.hidden = false;
        this.reasoningBox.replaceChildren(ds4md.render(this.reasoning));
      }
      this.body.replaceChildren(ds4md.render(this.content));
      this.onUpdate();
    }

    statsText(how) {
      const out = [];
      if (this.tFirst !== null) out.push("TTFT " + Math.round(this.tFirst - this.t0) + " ms");
      const tokens = this.usage ? this.usage.completion_tokens : this.pieces;
      if (tokens) out.push(tokens + " tokens");
      const span = ((this.tLast || 0) - (this.tFirst || 0)) / 1000;
      if (tokens > 1 && span > 0) out.push((Math.max(tokens - 1, 1) / span).toFixed(1) + " tok/s");
      if (this.finishReason) out.push("finish: " + this.finishReason);
      if (how === "stopped") out.push("stopped");
      return out.join(" · ");
    }

    finish(how) {
      clearTimeout(this.timer);
      this.timer = null;
      this.render();
      if (how === "stopped" && !this.content && !this.reasoning) this.body.textContent = "(stopped)";
      this.stats.textContent = this.statsText(how);
      this.node.dataset.state = how;
      this.onUpdate();
    }

    fail(exc) {
      this.finish("error");
      const status = exc && exc.status ? "Error " + exc.status : "Error";
      const code = exc && exc.code ? " (" + exc.code + ")" : "";
      const retry = exc && exc.retryAfter ? " (retry after " + exc.retryAfter + " s)" : "";
      this.errorBox.textContent = status + code + ": " + (exc && exc.message || String(exc)) + retry;
      this.errorBox.hidden = false;
      this.node.dataset.state = "error";
      this.onUpdate();
    }
  }

  global.ds4reply = Object.freeze({ Reply });
})(window);
