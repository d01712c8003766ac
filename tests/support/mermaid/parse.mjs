// Parse Mermaid diagrams with Mermaid's own parser (no rendering, no browser).
// stdin: a JSON list of {"where": "docs/x.md:12", "text": "..."}; stdout: a JSON list of
// {"where", "type"} for a diagram that parses or {"where", "error"} for one that does not.
import { JSDOM } from "jsdom";

// Mermaid sanitizes labels with DOMPurify, which needs a window even to parse.
const dom = new JSDOM("<!doctype html><html><body></body></html>");
globalThis.window = dom.window;
globalThis.document = dom.window.document;
const { default: mermaid } = await import("mermaid");
mermaid.initialize({ startOnLoad: false });

let input = "";
for await (const chunk of process.stdin) input += chunk;
const results = [];
for (const { where, text } of JSON.parse(input)) {
  try {
    const parsed = await mermaid.parse(text);
    results.push({ where, type: parsed.diagramType });
  } catch (err) {
    results.push({ where, error: String(err && err.message ? err.message : err) });
  }
}
process.stdout.write(JSON.stringify(results));
