// The chat page's markdown (loaded before chat.js): renderMarkdown(text) -> HTML, every
// character of the text escaped and only the renderer's own tags let through; code
// highlighted by one regular expression per comment style. No dependencies.
"use strict";

// ---- markdown ---------------------------------------------------------------------

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const LINK = /\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;
const BARE_URL = /\bhttps?:\/\/[^\s<>"'`]*[^\s<>"'`.,;:!?)\]]/g;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s{0,3}>\s?/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)+\|?\s*$|^\s*\|\s*:?-+:?\s*\|\s*$/;

function link(url, label) {
  return `<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${label}</a>`;
}

// One line of text -> HTML. Code spans and links are rendered first and held aside
// (as \0N\0) so that the emphasis rules, which run on escaped text, never reach into
// them.
function renderInline(text) {
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = String(text).replace(/\u0000/g, "");
  s = s.replace(/`([^`\n]+)`/g, (_, code) => hold(`<code>${escapeHtml(code)}</code>`));
  s = s.replace(LINK, (_, label, url) => hold(link(url, emphasis(escapeHtml(label)))));
  s = s.replace(BARE_URL, (url) => hold(link(url, escapeHtml(url))));
  s = emphasis(escapeHtml(s));
  const restore = (t) => t.replace(/\u0000(\d+)\u0000/g, (_, i) => restore(held[Number(i)]));
  return restore(s);
}

function emphasis(escaped) {
  return escaped
    .replace(/\*\*(?=\S)([^\n]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([^\n]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^\w*])\*(?=[^\s*])([^*\n]*?[^\s*]|[^\s*])\*(?![\w*])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_]|[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([^\n]*?\S)~~/g, "<del>$1</del>");
}

function indentOf(line) {
  return line.match(/^\s*/)[0].length;
}

function startsBlock(lines, i) {
  const line = lines[i];
  return (
    FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    LIST_ITEM.test(line) || isTableStart(lines, i)
  );
}

function isTableStart(lines, i) {
  return lines[i].includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]);
}

function tableCells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

// Markdown -> HTML: headings, paragraphs (line breaks kept), lists (nested by
// indentation), block quotes, rules, tables, fenced code. A fence still open at the
// end (an answer still streaming) runs to the end.
function renderMarkdown(text) {
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = line.match(FENCE))) {
      const code = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(m[1]); i++) code.push(lines[i]);
      i++;
      out.push(codeBlock(code.join("\n"), m[2]));
    } else if ((m = line.match(HEADING))) {
      const level = m[1].length;
      out.push(`<h${level}>${renderInline(m[2])}</h${level}>`);
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) {
        quoted.push(lines[i].replace(QUOTE, ""));
      }
      out.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
    } else if (isTableStart(lines, i)) {
      i = renderTable(lines, i, out);
    } else if (LIST_ITEM.test(line)) {
      i = renderList(lines, i, out);
    } else {
      const paragraph = [line];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines, i); i++) {
        paragraph.push(lines[i]);
      }
      out.push(`<p>${paragraph.map((l) => renderInline(l.trim())).join("<br>")}</p>`);
    }
  }
  return out.join("\n");
}

// A list from lines[start]; returns the index after it. An item's own lines (more
// indented, or after a blank line inside the list) are rendered as markdown of their own.
function renderList(lines, start, out) {
  const first = lines[start].match(LIST_ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  let i = start;
  for (; i < lines.length; i++) {
    const line = lines[i];
    const m = line.match(LIST_ITEM);
    if (m && m[1].length <= indent) {
      if (m[1].length < indent || /\d/.test(m[2]) !== ordered) break;
      items.push({ lines: [m[3]], contentIndent: indent + m[2].length + 1 });
    } else if (!line.trim()) {
      const next = lines[i + 1];
      if (next === undefined || !next.trim()) break;
      const more = LIST_ITEM.test(next) ? indentOf(next) >= indent : indentOf(next) > indent;
      if (!more) break;
      items.at(-1).lines.push("");
    } else if (indentOf(line) > indent || !startsBlock(lines, i)) {
      const item = items.at(-1);
      item.lines.push(line.slice(Math.min(indentOf(line), item.contentIndent)));
    } else {
      break;
    }
  }
  const tag = ordered ? "ol" : "ul";
  const number = parseInt(first[2], 10);
  const startAttr = ordered && number !== 1 ? ` start="${number}"` : "";
  const html = items.map((item) =>
    item.lines.length === 1 ? renderInline(item.lines[0]) : renderMarkdown(item.lines.join("\n")),
  );
  out.push(`<${tag}${startAttr}>${html.map((h) => `<li>${h}</li>`).join("")}</${tag}>`);
  return i;
}

function renderTable(lines, start, out) {
  const aligns = tableCells(lines[start + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : "",
  );
  const row = (line, tag) =>
    "<tr>" +
    tableCells(line)
      .map((cell, j) => {
        const align = aligns[j] ? ` class="align-${aligns[j]}"` : "";
        return `<${tag}${align}>${renderInline(cell)}</${tag}>`;
      })
      .join("") +
    "</tr>";
  let i = start + 2;
  const body = [];
  for (; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
    body.push(row(lines[i], "td"));
  }
  const head = `<thead>${row(lines[start], "th")}</thead>`;
  out.push(`<table>${head}<tbody>${body.join("")}</tbody></table>`);
  return i;
}

function codeBlock(code, lang) {
  const label = `<span class="lang">${escapeHtml(lang || "code")}</span>`;
  const copy = '<button type="button" class="copy">Copy</button>';
  const pre = `<pre><code>${highlight(code, lang)}</code></pre>`;
  return `<div class="code"><div class="code-bar">${label}${copy}</div>${pre}</div>`;
}

// ---- syntax highlighting: one pass of one regular expression per comment style ----

const KEYWORDS = new Set(
  ("and as assert async await break case catch class const continue def default defer del " +
    "do elif else enum except export extends finally fn for from func function go if impl " +
    "import in interface is lambda let loop match mod module mut new nonlocal not of or " +
    "package pass pub raise return static struct super switch this throw throws trait try " +
    "type typeof use var void where while with yield int float double char bool boolean " +
    "string str long short unsigned auto self").split(" "),
);
const LITERALS = new Set("true false True False None null nil undefined NaN".split(" "));
const HASH_COMMENTS = new Set(
  ("python py bash sh shell zsh console ruby rb yaml yml toml perl r makefile dockerfile " +
    "ini conf powershell ps1 julia nim elixir").split(" "),
);
const DASH_COMMENTS = new Set("sql lua haskell hs ada".split(" "));
const STRINGS =
  String.raw`"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|` +
  "`(?:[^`\\\\]|\\\\.)*`";
const NUMBER = String.raw`\b(?:0[xX][\da-fA-F]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b`;
const patterns = new Map(); // comment style -> its token pattern

function tokenPattern(lang) {
  let style = lang ? "c" : "any";
  if (HASH_COMMENTS.has(lang)) style = "hash";
  if (DASH_COMMENTS.has(lang)) style = "dash";
  if (!patterns.has(style)) {
    const comment = {
      hash: String.raw`#[^\n]*`,
      dash: String.raw`--[^\n]*`,
      c: String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)`,
      any: String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)|#[^\n]*`,
    }[style];
    const source = `(${comment})|(${STRINGS})|(${NUMBER})|([A-Za-z_$][\\w$]*)(\\s*\\()?`;
    patterns.set(style, new RegExp(source, "g"));
  }
  return patterns.get(style);
}

// Code -> escaped HTML with <span class="tok-*"> around comments, strings, numbers,
// keywords, literals and called names.
function highlight(code, lang) {
  let html = "";
  let last = 0;
  for (const m of code.matchAll(tokenPattern((lang || "").toLowerCase()))) {
    const [text, comment, string, number, word, call] = m;
    html += escapeHtml(code.slice(last, m.index));
    last = m.index + text.length;
    const kind = comment ? "c" : string ? "s" : number ? "n" : KEYWORDS.has(word) ? "k"
      : LITERALS.has(word) ? "l" : call ? "f" : "";
    const token = escapeHtml(word ?? text);
    html += (kind ? `<span class="tok-${kind}">${token}</span>` : token) + escapeHtml(call ?? "");
  }
  return html + escapeHtml(code.slice(last));
}
