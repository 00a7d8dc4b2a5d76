// A small markdown renderer for model output, safe by construction.
//
// Model output is untrusted, so this never parses HTML: every piece of text becomes a DOM text node
// (document.createTextNode / textContent), and the only elements made are a fixed list (p, h1-h6,
// ul, ol, li, blockquote, pre, code, strong, em, del, a, br, hr, table cells). A raw "<script>" in the
// output is shown as the characters "<script>". Links keep only http(s) and mailto URLs (anything
// else, javascript: included, is shown as text); they open in a new tab with no opener/referrer.
// Supported: fenced code blocks (``` or ~~~, with a language label), headings, lists (nested by
// indentation), blockquotes, rules, pipe tables, paragraphs with line breaks, and inline code,
// **bold**, *italic* / _italic_, ~~strike~~, [links](url) and bare http(s) URLs.
"use strict";

(function (global) {
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  function el(tag, cls) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    return node;
  }

  // ---- inline ----------------------------------------------------------------------------------
  // One alternation, tried left to right: the earliest match wins, text before it is plain text.
  const INLINE = new RegExp([
    "(`+)([\\s\\S]*?[^`])\\1(?!`)",              // 1,2: code span
    "\\[([^\\]\\n]+)\\]\\(([^()\\s]+)\\)",        // 3,4: [text](url)
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",          // 5: **bold**
    "(?<![A-Za-z0-9])__(?=\\S)([\\s\\S]*?\\S)__(?![A-Za-z0-9])", // 6: __bold__ (not inside words)
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*",         // 7: *italic*
    "(?<![A-Za-z0-9])_(?=\\S)([^_]*?\\S)_(?![A-Za-z0-9])", // 8: _italic_ (not inside snake_case)
    "~~(?=\\S)([\\s\\S]*?\\S)~~",                   // 9: ~~strike~~
    "(https?:\\/\\/[^\\s<>()]*[^\\s<>().,;:!?'\"])", // 10: bare URL
  ].join("|"));

  function link(parent, text, url) {
    if (!SAFE_URL.test(url)) {  // not a link: the source is shown as it was written
      parent.appendChild(document.createTextNode(text === url ? url : "[" + text + "](" + url + ")"));
      return;
    }
    const a = el("a");
    a.href = url;  // a property, checked above: never a javascript: or data: URL
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    a.referrerPolicy = "no-referrer";
    if (text === url) a.textContent = url; else inline(a, text);
    parent.appendChild(a);
  }

  function wrap(parent, tag, inner) {
    const node = el(tag);
    inline(node, inner);
    parent.appendChild(node);
  }

  function text(parent, s) {
    // single newlines inside a paragraph are line breaks (chat answers rely on them)
    const lines = s.split("\n");
    lines.forEach((line, i) => {
      if (i > 0) parent.appendChild(el("br"));
      if (line) parent.appendChild(document.createTextNode(line));
    });
  }

  function inline(parent, s) {
    let rest = s;
    while (rest) {
      const m = INLINE.exec(rest);
      if (!m) { text(parent, rest); return; }
      if (m.index > 0) text(parent, rest.slice(0, m.index));
      if (m[2] !== undefined) {
        const code = el("code");
        code.textContent = m[2].replace(/^ (.*) $/s, "$1");
        parent.appendChild(code);
      } else if (m[3] !== undefined) link(parent, m[3], m[4]);
      else if (m[5] !== undefined) wrap(parent, "strong", m[5]);
      else if (m[6] !== undefined) wrap(parent, "strong", m[6]);
      else if (m[7] !== undefined) wrap(parent, "em", m[7]);
      else if (m[8] !== undefined) wrap(parent, "em", m[8]);
      else if (m[9] !== undefined) wrap(parent, "del", m[9]);
      else link(parent, m[10], m[10]);
      rest = rest.slice(m.index + m[0].length);
    }
  }

  // ---- blocks ----------------------------------------------------------------------------------
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const QUOTE = /^ {0,3}>\s?(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function codeBlock(root, lines, i) {
    const open = FENCE.exec(lines[i]);
    const body = [];
    let j = i + 1;
    for (; j < lines.length; j++) {
      const l = lines[j];
      if (l.trim().startsWith(open[1][0].repeat(open[1].length)) && /^\s*[`~]+\s*$/.test(l)) break;
      body.push(l);
    }
    const pre = el("pre");
    if (open[2]) {
      const label = el("span", "code-lang");
      label.textContent = open[2];
      pre.appendChild(label);
    }
    const code = el("code");
    code.textContent = body.join("\n");  // still streaming: an unclosed fence runs to the end
    pre.appendChild(code);
    root.appendChild(pre);
    return j + 1;
  }

  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|")) s = s.slice(0, -1);
    return s.split("|").map((c) => c.trim());
  }

  function table(root, lines, i) {
    const t = el("table");
    const head = el("tr");
    splitRow(lines[i]).forEach((c) => wrap(head, "th", c));
    t.appendChild(el("thead")).appendChild(head);
    const body = t.appendChild(el("tbody"));
    let j = i + 2;
    for (; j < lines.length && lines[j].includes("|") && lines[j].trim(); j++) {
      const row = el("tr");
      splitRow(lines[j]).forEach((c) => wrap(row, "td", c));
      body.appendChild(row);
    }
    root.appendChild(t);
    return j;
  }

  function list(root, lines, i) {
    // items at the first item's indentation; deeper-indented lines belong to the item above
    const first = ITEM.exec(lines[i]);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const node = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    let j = i;
    while (j < lines.length) {
      const m = ITEM.exec(lines[j]);
      if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
      const inner = [m[3]];
      j++;
      while (j < lines.length && lines[j].trim() && (/^\s/.test(lines[j]) && leading(lines[j]) > indent)) {
        inner.push(lines[j].slice(Math.min(leading(lines[j]), indent + 2)));
        j++;
      }
      const li = el("li");
      blocks(li, inner, true);
      node.appendChild(li);
      while (j < lines.length && !lines[j].trim() && j + 1 < lines.length && ITEM.test(lines[j + 1])
             && ITEM.exec(lines[j + 1])[1].length === indent) j++;  // loose lists: blank lines between items
    }
    root.appendChild(node);
    return j;
  }

  function leading(line) { return line.length - line.trimStart().length; }

  function startsBlock(lines, j) {
    const l = lines[j];
    return FENCE.test(l) || HEADING.test(l) || RULE.test(l) || QUOTE.test(l) || ITEM.test(l)
      || (l.includes("|") && j + 1 < lines.length && TABLE_SEP.test(lines[j + 1]));
  }

  function blocks(root, lines, tight) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) { i++; continue; }
      if (FENCE.test(line)) { i = codeBlock(root, lines, i); continue; }
      let m = HEADING.exec(line);
      if (m) { wrap(root, "h" + m[1].length, m[2]); i++; continue; }
      if (RULE.test(line)) { root.appendChild(el("hr")); i++; continue; }
      if (QUOTE.test(line)) {
        const inner = [];
        for (; i < lines.length && (m = QUOTE.exec(lines[i])); i++) inner.push(m[1]);
        blocks(root.appendChild(el("blockquote")), inner, false);
        continue;
      }
      if (ITEM.test(line)) { i = list(root, lines, i); continue; }
      if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
        i = table(root, lines, i);
        continue;
      }
      const para = [line.trim()];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines, i); i++) para.push(lines[i].trim());
      if (tight && root.tagName === "LI" && !root.firstChild) inline(root, para.join("\n"));
      else wrap(root, "p", para.join("\n"));
    }
  }

  /** Render markdown ``source`` into a new <div class="md"> (text nodes only; see the header). */
  function render(source) {
    const root = el("div", "md");
    blocks(root, String(source).replace(/\r\n?/g, "\n").split("\n"), false);
    return root;
  }

  global.ds4md = Object.freeze({ render });
})(window);
