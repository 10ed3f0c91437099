"""``GET /``: a self-contained chat page that colours every generated token by its experts.

No external scripts, fonts or styles (works offline). It streams ``/v1/chat/completions``
(or ``/v1/completions`` in "complete" mode) with the ``routing`` extension and paints each
token with the hue of the expert that the chosen layer ranked first; hovering a token shows
the experts of every MoE layer. ``/?prompt=...&mode=complete&max_tokens=N`` runs once on load;
``&stream=0`` asks for one JSON response instead of a stream (used by the browser test).
"""

from __future__ import annotations

import html
import json
from typing import Any

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>moelab serve: __NAME__</title>
<style>
 body { font: 15px/1.5 system-ui, sans-serif; margin: 0; background: #f6f6f4; color: #222; }
 header { padding: 10px 18px; background: #263238; color: #eceff1; }
 header b { font-size: 17px; } header span { opacity: .8; margin-left: 12px; font-size: 13px; }
 main { max-width: 960px; margin: 0 auto; padding: 14px 18px; }
 #log .turn { margin: 10px 0; padding: 8px 12px; border-radius: 8px; white-space: pre-wrap;
   word-break: break-word; }
 #log .user { background: #e3f2fd; } #log .assistant { background: #fff; border: 1px solid #ddd; }
 .tok { border-radius: 3px; padding: 0 1px; font-family: ui-monospace, monospace; }
 form { display: flex; gap: 8px; flex-wrap: wrap; align-items: center; margin-top: 12px; }
 textarea { flex: 1 1 100%; min-height: 60px; font: inherit; padding: 6px; }
 label { font-size: 13px; } input[type=number] { width: 70px; }
 #legend span { display: inline-block; min-width: 26px; text-align: center; margin: 2px;
   border-radius: 3px; font-size: 12px; }
 #status { font-size: 13px; color: #555; }
</style></head>
<body>
<header><b>moelab serve</b><span id="card"></span></header>
<main>
 <div id="log"></div>
 <form id="f">
  <textarea id="prompt" placeholder="Say something to the model"></textarea>
  <label>mode <select id="mode"><option value="chat">chat</option>
    <option value="complete">complete</option></select></label>
  <label>colour by layer <select id="layer"></select></label>
  <label>max tokens <input id="max" type="number" value="64" min="1"></label>
  <label>temperature <input id="temp" type="number" value="0.7" min="0" step="0.1"></label>
  <label>API key <input id="key" type="password" size="10"></label>
  <button id="send" type="submit">Send</button> <span id="status"></span>
 </form>
 <p id="legend"></p>
</main>
<script>
const CFG = __CONFIG__;
const $ = (id) => document.getElementById(id);
const E = Math.max(CFG.num_experts, 1);
const hue = (e) => Math.round((e * 360) / E);
const colour = (e) => `hsl(${hue(e)}, 70%, 82%)`;
$("card").textContent = `${CFG.name}: ${CFG.n_layers} layers, ${CFG.num_experts} experts, top-${CFG.top_k}, context ${CFG.context_length}`;
CFG.moe_layers.forEach((l, i) => {
  const o = document.createElement("option"); o.value = i; o.textContent = `layer ${l}`;
  $("layer").appendChild(o);
});
for (let e = 0; e < CFG.num_experts; e++) {
  const s = document.createElement("span"); s.style.background = colour(e); s.textContent = e;
  $("legend").appendChild(s);
}
$("layer").onchange = () => document.querySelectorAll(".tok").forEach(paint);
function paint(span) {
  const ex = JSON.parse(span.dataset.experts || "[]");
  const li = Number($("layer").value || 0);
  if (ex.length && ex[li] && ex[li].length) span.style.background = colour(ex[li][0]);
}
const history = [];
function turn(role, text) {
  const d = document.createElement("div"); d.className = "turn " + role;
  d.textContent = text; $("log").appendChild(d); return d;
}
async function send(prompt) {
  const mode = $("mode").value;
  const streamed = new URLSearchParams(location.search).get("stream") !== "0";
  turn("user", prompt);
  const out = turn("assistant", "");
  const body = { model: CFG.name, stream: streamed, routing: true,
    max_tokens: Number($("max").value), temperature: Number($("temp").value) };
  let url = "/v1/completions";
  if (mode === "chat") {
    history.push({ role: "user", content: prompt });
    body.messages = history.slice(); url = "/v1/chat/completions";
  } else { body.prompt = prompt; }
  const headers = { "Content-Type": "application/json" };
  if ($("key").value) headers["Authorization"] = "Bearer " + $("key").value;
  $("status").textContent = "generating...";
  let reply = "", n = 0;
  const show = (c) => {
    for (const t of (c.routing && c.routing.tokens) || []) {
      const s = document.createElement("span"); s.className = "tok";
      s.textContent = t.text; s.dataset.experts = JSON.stringify(t.experts);
      s.title = t.experts.map((ex, i) => `layer ${CFG.moe_layers[i]}: ${ex.join(", ")}`).join("\\n");
      paint(s); out.appendChild(s); n++;
    }
    reply += (c.delta && c.delta.content) || (c.message && c.message.content) || c.text || "";
  };
  try {
    const r = await fetch(url, { method: "POST", headers, body: JSON.stringify(body) });
    if (!r.ok) { const j = await r.json(); throw new Error(j.error ? j.error.message : r.status); }
    if (!streamed) { (await r.json()).choices.forEach(show); }
    const reader = streamed ? r.body.getReader() : null;
    const dec = new TextDecoder(); let buf = "";
    while (reader) {
      const { value, done } = await reader.read(); if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\\n\\n")) >= 0) {
        const line = buf.slice(0, cut).trim(); buf = buf.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim(); if (data === "[DONE]") continue;
        const j = JSON.parse(data);
        if (j.error) throw new Error(j.error.message);
        (j.choices || []).forEach(show);
      }
    }
    $("status").textContent = `${n} tokens`;
    document.body.dataset.done = String(n);
  } catch (err) { $("status").textContent = "error: " + err.message; }
  if (mode === "chat") history.push({ role: "assistant", content: reply });
}
$("f").onsubmit = (ev) => { ev.preventDefault(); const p = $("prompt").value; if (p) send(p); };
const q = new URLSearchParams(location.search);
if (q.get("mode")) $("mode").value = q.get("mode");
if (q.get("max_tokens")) $("max").value = q.get("max_tokens");
if (q.get("temperature")) $("temp").value = q.get("temperature");
if (q.get("prompt")) send(q.get("prompt"));
</script>
</body></html>
"""


def render_page(card: dict[str, Any]) -> str:
    """The page for a model described by :func:`moelab.serve.card.model_card`."""
    config = json.dumps(card).replace("<", "\\u003c")  # cannot close the script element
    return _PAGE.replace("__NAME__", html.escape(card["name"])).replace("__CONFIG__", config)
