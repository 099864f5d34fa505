// Markdown to DOM, safely: every piece of the model's text becomes a text node or the
// text of an element this file makes (pre, code, p, li, h3-h6, strong, em, and links
// to http(s) only). Nothing the model writes is parsed as HTML: a <script> in an
// answer is shown as text, and the page's CSP stays as strict as ever.
"use strict";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d+[.)])\s+/;

function renderMarkdown(target, text) {
  const out = [];
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const code = [];
      i++;
      while (i < lines.length && !lines[i].trimStart().startsWith(fence[1])) code.push(lines[i++]);
      i++;  // (the closing fence; an open one runs to the end, as the answer arrives)
      out.push(codeBlock(code.join("\n"), fence[2]));
    } else if (HEADING.test(line)) {
      const m = line.match(HEADING);
      out.push(inline(el("h" + Math.min(6, m[1].length + 2), {}), m[2]));
      i++;
    } else if (ITEM.test(line)) {
      const list = el(/^\s*\d/.test(line) ? "ol" : "ul", {});
      while (i < lines.length && ITEM.test(lines[i])) list.append(inline(el("li", {}), lines[i++].replace(ITEM, "")));
      out.push(list);
    } else if (!line.trim()) {
      i++;
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) && !ITEM.test(lines[i])) para.push(lines[i++]);
      out.push(inline(el("p", {}), para.join("\n")));
    }
  }
  target.replaceChildren(...out);
}

function codeBlock(code, lang) {
  const copy = el("button", { type: "button", class: "copy", title: "copy the code" }, "copy");
  copy.addEventListener("click", () => navigator.clipboard.writeText(code).then(
    () => { copy.textContent = "copied"; }, () => { copy.textContent = "copy failed"; }));
  return el("div", { class: "code" }, copy, el("pre", {}, el("code", lang ? { class: "language-" + lang } : {}, code)));
}

const INLINE = /(`+)([\s\S]*?)\1|\*\*([\s\S]+?)\*\*|\*([^*\s][^*]*?)\*|\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g;

function inline(node, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) node.append(text.slice(last, m.index));
    if (m[1]) node.append(el("code", {}, m[2]));
    else if (m[3] !== undefined) node.append(inline(el("strong", {}), m[3]));
    else if (m[4] !== undefined) node.append(el("em", {}, m[4]));
    else node.append(el("a", { href: m[6], rel: "noopener noreferrer", target: "_blank" }, m[5]));
    last = m.index + m[0].length;
  }
  if (last < text.length) node.append(text.slice(last));
  return node;
}
