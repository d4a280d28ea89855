// A small Markdown renderer for model output that builds DOM nodes directly: model text only ever
// reaches the page as text nodes (never as HTML), so nothing it says can inject markup or script.
// Covers what chat models write: code fences, inline code, bold/italic, headings, lists, quotes, rules,
// links (http, https and mailto only) and bare URLs. Unclosed constructs (mid-stream) render as text.

const SAFE_SCHEMES = new Set(["http:", "https:", "mailto:"]);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/** The URL if its scheme is allowed, else null. */
export function safeUrl(href) {
  try {
    const url = new URL(href);
    return SAFE_SCHEMES.has(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

// Earliest match wins; each alternative has its own group numbers (see renderInline).
const INLINE = new RegExp(
  [
    "`([^`\\n]+)`", // 1 code
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 2 bold
    "__(?=\\S)([\\s\\S]*?\\S)__", // 3 bold
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*", // 4 italic
    "(?<![\\p{L}\\p{N}_])_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?![\\p{L}\\p{N}_])", // 5 italic
    "\\[([^\\]\\n]+)\\]\\(([^()\\s]+)(?:\\s+\"[^\"\\n]*\")?\\)", // 6 text, 7 href
    "(https?:\\/\\/[^\\s<>()\\[\\]]*[^\\s<>()\\[\\].,;:!?'\"])", // 8 bare URL
  ].join("|"),
  "u",
);

function link(href, text, parent) {
  const url = safeUrl(href);
  if (!url) {
    parent.append(text === href ? href : `${text} (${href})`);
    return;
  }
  const a = el("a", "", text);
  a.href = url;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  parent.append(a);
}

/** Inline Markdown of one block's text, appended to ``parent``. */
export function renderInline(text, parent) {
  let rest = text;
  while (rest) {
    const m = INLINE.exec(rest);
    if (!m) {
      parent.append(rest);
      return;
    }
    if (m.index > 0) parent.append(rest.slice(0, m.index));
    if (m[1] !== undefined) parent.append(el("code", "", m[1]));
    else if (m[2] !== undefined || m[3] !== undefined) renderInline(m[2] ?? m[3], parent.appendChild(el("strong")));
    else if (m[4] !== undefined || m[5] !== undefined) renderInline(m[4] ?? m[5], parent.appendChild(el("em")));
    else if (m[6] !== undefined) link(m[7], m[6], parent);
    else link(m[8], m[8], parent);
    rest = rest.slice(m.index + m[0].length);
  }
}

function withBreaks(lines, parent) {
  lines.forEach((line, i) => {
    if (i > 0) parent.append(el("br"));
    renderInline(line, parent);
  });
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const INDENTED = /^( {4}|\t)/;

function codeBlock(lang, code) {
  const wrap = el("div", "code-block");
  const bar = el("div", "code-bar");
  bar.append(el("span", "code-lang", lang || "text"));
  const copy = el("button", "copy", "Copy");
  copy.type = "button";
  copy.setAttribute("aria-label", `Copy ${lang || "code"} block`);
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(code);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Copy failed";
    }
    setTimeout(() => (copy.textContent = "Copy"), 1500);
  });
  bar.append(copy);
  const pre = el("pre");
  const codeEl = el("code", lang ? `language-${lang}` : "", code);
  pre.append(codeEl);
  pre.tabIndex = 0; // long lines scroll: reachable by keyboard
  wrap.append(bar, pre);
  return wrap;
}

function list(lines, start) {
  // Items at the first item's indentation belong to this list; deeper ones nest.
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  let i = start;
  let item = null;
  while (i < lines.length) {
    const line = lines[i];
    const m = ITEM.exec(line);
    if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
      item = node.appendChild(el("li"));
      renderInline(m[3], item);
      i += 1;
    } else if (m && m[1].length > indent && item) {
      const [child, next] = list(lines, i);
      item.append(child);
      i = next;
    } else if (!m && line.trim() && /^\s+/.test(line) && item) {
      item.append(el("br"));
      renderInline(line.trim(), item); // continuation line of the item
      i += 1;
    } else {
      break;
    }
  }
  return [node, i];
}

/** Markdown ``text`` as a DocumentFragment of safe nodes. */
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  let para = [];
  const flush = () => {
    if (para.length) withBreaks(para, out.appendChild(el("p")));
    para = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      flush();
      const marker = m[1];
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trimStart().startsWith(marker)) body.push(lines[i++]);
      i += 1; // the closing fence (or past the end while it is still streaming)
      out.append(codeBlock(m[2], body.join("\n")));
    } else if ((m = HEADING.exec(line))) {
      flush();
      const level = Math.min(m[1].length + 2, 6); // inside a message: below the page's own headings
      renderInline(m[2], out.appendChild(el(`h${level}`)));
      i += 1;
    } else if (RULE.test(line) && !para.length) {
      out.append(el("hr"));
      i += 1;
    } else if (ITEM.test(line) && (!para.length || !/^\s/.test(line))) {
      flush();
      const [node, next] = list(lines, i);
      out.append(node);
      i = next;
    } else if ((m = QUOTE.exec(line))) {
      flush();
      const quoted = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        quoted.push(m[1]);
        i += 1;
      }
      withBreaks(quoted, out.appendChild(el("blockquote")));
    } else if (INDENTED.test(line) && !para.length && line.trim()) {
      // Indented code (cannot interrupt a paragraph, as in CommonMark).
      const body = [];
      while (i < lines.length && (INDENTED.test(lines[i]) || !lines[i].trim())) {
        body.push(lines[i].replace(INDENTED, ""));
        i += 1;
      }
      while (body.length && !body[body.length - 1].trim()) body.pop();
      out.append(codeBlock("", body.join("\n")));
    } else if (!line.trim()) {
      flush();
      i += 1;
    } else {
      para.push(line);
      i += 1;
    }
  }
  flush();
  return out;
}
