// The stemlm playground page: calls the JSON API of stemlm/serve/app.py and draws the results.
// Plain browser JavaScript, no libraries, so the page works offline. Errors from the server arrive as
// {"error": message} and are shown in the banner at the top of the page.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  info: null, tokens: [], span: null, edit: null, nearest: new Map(), contribution: null, pendingSave: null,
};
const SHOWN_WORDS = 12; // words sharing a changed token listed inline; the rest behind "more"
// Plain words for the edit module's strategies and pad rows (stemlm/edit/spans.py explains them): a short
// label for the menu and a sentence for its tooltip. Every name the server lists must have one
// (tests/serve/test_page.py).
const STRATEGY_WORDS = {
  auto: ["automatic", "token by token when the names are equally long; else the target repeated (longer source) or its last tokens (longer target)"],
  one_to_one: ["token by token", "equal lengths only: the source's j-th token takes the target's j-th token's rows"],
  left_pad: ["target at the end, padding first", "longer source: the target fills its last positions, the first ones get the padding row"],
  right_pad: ["target at the start, padding after", "longer source: the target fills its first positions, the rest get the padding row"],
  copy: ["target repeated", "longer source: the target's tokens repeated from the first position, no padding"],
  subset: ["target's last tokens", "longer target: the source's positions take the target's last tokens"],
  average: ["target averaged", "longer target: split into as many groups as the source has tokens; each position takes its group's mean row"],
};
const PAD_WORDS = {
  eot: ["end-of-text row", "the row of <|endoftext|>, an entity-free row the model sees at every document boundary"],
  source: ["source's own row", "padded positions keep the source token's own row"],
  zero: ["zero row", "no STEM output at padded positions, a state the model never saw in training"],
};

function showError(message) {
  $("error-text").textContent = message;
  $("error").hidden = false;
}
function clearError() { $("error").hidden = true; }

async function api(path, body) {
  const response = await fetch(path, body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  let data = null;
  try { data = await response.json(); } catch (_) { /* a non-JSON answer: reported below */ }
  if (!response.ok) {
    const err = new Error((data && data.error) || `${path}: HTTP ${response.status}`);
    err.data = data; // the whole answer: a refused save carries the tokens it would change
    throw err;
  }
  return data;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}
const shown = (text) => text.replace(/\n/g, "↵");
const prob = (p) => (p >= 0.001 ? p.toFixed(4) : p.toExponential(2));

function sampling() {
  const num = (id) => Number($(id).value);
  return {
    prompt: $("prompt").value, max_new_tokens: num("max-new-tokens"), temperature: num("temperature"),
    top_k: num("top-k"), top_p: num("top-p"), seed: num("seed"), greedy: $("greedy").checked,
  };
}

// While a request runs its button is disabled and the status line says what runs and for how long, since an
// edit or a heat map of a large model takes many seconds.
async function withBusy(button, work) {
  clearError();
  button.disabled = true;
  const started = Date.now();
  const label = button.textContent.trim();
  const tick = () => { $("busy").textContent = `${label}: working… ${Math.floor((Date.now() - started) / 1000)} s`; };
  tick();
  $("busy").hidden = false;
  const timer = setInterval(tick, 500);
  try { await work(); } catch (err) { showError(err.message); } finally {
    clearInterval(timer);
    $("busy").hidden = true;
    button.disabled = false;
  }
}

// ----- model info and tabs -----
async function loadInfo() {
  const info = await api("/api/info");
  state.info = info;
  // The layers with token tables: "STEM layers" for the STEM kind, else the kind's own name.
  const tableWord = info.ffn === "stem" ? "STEM" : info.ffn;
  const stem = info.table_layers.length
    ? `${tableWord} layers ${info.table_layers.join(", ")}`
    : `no ${tableWord} table layers`;
  $("model-info").textContent =
    `${info.checkpoint} · ffn=${info.ffn} · ${info.num_layers} layers · ${stem} · vocab ${info.vocab_size} · tables ${info.tables}`;
  for (const s of info.strategies) $("edit-strategy").append(new Option(STRATEGY_WORDS[s][0], s));
  const [editPad, savePad] = [PAD_WORDS[info.default_pad][0], PAD_WORDS[info.global_default_pad][0]];
  $("edit-pad").append(new Option(`default: ${editPad} (saved edits: ${savePad})`, ""));
  for (const p of info.pads) $("edit-pad").append(new Option(PAD_WORDS[p][0], p));
  describeChoices();
  for (const name of info.entities) $("entities").append(new Option(name));
  for (const layer of info.table_layers) {
    const label = el("label", "check");
    const box = el("input");
    Object.assign(box, { type: "checkbox", checked: true, value: layer, id: `layer-${layer}` });
    label.append(box, ` layer ${layer}`);
    $("edit-layers").append(label);
  }
  if (info.editing) {
    $("edit-notice").textContent = `STEM row edits are unavailable: ${info.editing}`;
    $("edit-notice").hidden = false;
  }
  $("save-btn").disabled = !info.can_save;
  $("save-btn").title = info.can_save ? `saves under ${info.save_dir}` : "start the server with --save-dir to save";
}

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    for (const other of document.querySelectorAll(".tab")) {
      other.classList.toggle("active", other === tab);
      $(other.dataset.panel).hidden = other !== tab;
    }
    if (tab.id === "tab-edit") refreshTokens().catch((err) => showError(err.message));
  });
}

// ----- generate: a POST answered with server-sent events, read from the response body -----
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const event = (frame.match(/^event: (.*)$/m) || [])[1];
      const data = (frame.match(/^data: (.*)$/m) || [])[1];
      if (event && data) onEvent(event, JSON.parse(data));
    }
  }
}

function showCache(cache) {
  if (!cache) return;
  const c = cache.cache;
  $("cache-stats").hidden = false;
  $("cache-stats").textContent =
    `STEM tables in host memory, device row cache ${cache.cache_rows} rows (${c.policy})\n` +
    `hits ${c.hits} / ${c.unique_ids} (${(100 * c.hit_rate).toFixed(1)}%), misses ${c.misses}, ` +
    `evictions ${c.evictions}, bypassed ${c.bypassed}, steps ${c.steps}, ` +
    `${(c.bytes_h2d / 2 ** 20).toFixed(2)} MiB host→device, ${(1000 * c.wait_seconds).toFixed(1)} ms waiting`;
}

$("generate-btn").addEventListener("click", () => withBusy($("generate-btn"), async () => {
  const out = $("generate-output");
  out.replaceChildren(el("span", "prompt-text", $("prompt").value));
  const completion = el("span", "completion");
  out.append(completion);
  $("generate-stats").textContent = "generating…";
  const response = await fetch("/api/generate", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(sampling()),
  });
  if (!response.ok) {
    $("generate-stats").textContent = "";
    const data = await response.json().catch(() => ({}));
    throw new Error(data.error || `generate: HTTP ${response.status}`);
  }
  let failure = null;
  await readEvents(response, (event, data) => {
    if (event === "token") completion.textContent += data.text;
    if (event === "error") failure = data.error;
    if (event === "done") {
      $("generate-stats").textContent =
        `${data.num_tokens} tokens in ${data.seconds.toFixed(2)} s (${data.tokens_per_s.toFixed(1)} tokens/s)`;
      showCache(data.cache);
    }
  });
  out.dataset.done = "1";
  if (failure) throw new Error(failure);
}));

// ----- see: heat map of STEM contributions, nearest tokens on hover -----
function heatColor(value, scale, diverging) {
  const t = scale > 0 ? Math.min(1, Math.abs(value) / scale) : 0;
  if (!diverging) return `rgba(37, 99, 235, ${0.08 + 0.85 * t})`;
  return value >= 0 ? `rgba(220, 38, 38, ${0.06 + 0.85 * t})` : `rgba(37, 99, 235, ${0.06 + 0.85 * t})`;
}

function drawHeatmap() {
  const data = state.contribution;
  if (!data) return;
  const metric = $("see-metric").value;
  const grid = data[metric];
  const scale = Math.max(...grid.flat().map(Math.abs));
  const table = el("table");
  const head = el("tr");
  head.append(el("th", "", ""));
  data.tokens.forEach((tok) => {
    const th = el("th", "tok", shown(tok.text));
    th.addEventListener("mouseenter", () => showNearest(tok));
    head.append(th);
  });
  table.append(head);
  data.layers.forEach((layer, row) => {
    const tr = el("tr");
    tr.append(el("th", "layer", `layer ${layer}`));
    grid[row].forEach((value, pos) => {
      const td = el("td", "cell", value.toFixed(2));
      td.style.background = heatColor(value, scale, metric === "grad_x_input");
      td.title = `${shown(data.tokens[pos].text)} · layer ${layer} · ${metric} ${value.toPrecision(4)}`;
      td.addEventListener("mouseenter", () => showNearest(data.tokens[pos]));
      tr.append(td);
    });
    table.append(tr);
  });
  $("heatmap").replaceChildren(table);
  $("see-predicted").textContent =
    `next token: "${shown(data.predicted.token)}" (log p ${data.logprob.toFixed(2)})`;
}

async function showNearest(token) {
  const box = $("nearest");
  if (!state.nearest.has(token.id)) state.nearest.set(token.id, api("/api/nearest", { token_id: token.id, k: 6 }));
  let result;
  try { result = await state.nearest.get(token.id); } catch (err) { state.nearest.delete(token.id); showError(err.message); return; }
  const title = el("div", "nearest-title", `nearest to "${shown(result.query.token)}" by row cosine`);
  const columns = el("div", "nearest-columns");
  for (const t of result.tables) {
    const col = el("div", "nearest-col");
    col.append(el("h4", "", t.name));
    for (const n of t.neighbours) col.append(el("div", "nb", `${shown(n.token)}  ${n.cosine.toFixed(2)}`));
    columns.append(col);
  }
  box.replaceChildren(title, columns);
  box.dataset.token = String(token.id);
}

$("see-btn").addEventListener("click", () => withBusy($("see-btn"), async () => {
  state.contribution = await api("/api/contribution", { prompt: $("prompt").value });
  drawHeatmap();
}));
$("see-metric").addEventListener("change", drawHeatmap);

// ----- edit: pick a span, apply, compare, toggle, save -----
// The strategy and pad menus' tooltips: what each menu decides and what its chosen entry does.
function describeChoices() {
  const strategy = $("edit-strategy").value;
  $("edit-strategy-label").title =
    `Which target rows each source position takes when the two names have different numbers of tokens.\n` +
    `${STRATEGY_WORDS[strategy][0]} (${strategy}): ${STRATEGY_WORDS[strategy][1]}.`;
  const pad = $("edit-pad").value;
  const chosen = pad
    ? `${PAD_WORDS[pad][0]} (${pad}): ${PAD_WORDS[pad][1]}.`
    : `default: ${PAD_WORDS[state.info.default_pad][1]}; a saved edit keeps the source's own row, since ` +
      "rewriting a padded token everywhere would change every other word sharing it.";
  $("edit-pad-label").title =
    `The row given to positions the target does not fill (only "padding first" and "padding after" leave any).\n${chosen}`;
}
$("edit-strategy").addEventListener("change", describeChoices);
$("edit-pad").addEventListener("change", describeChoices);

async function refreshTokens() {
  if (!$("prompt").value.trim()) { $("edit-tokens").replaceChildren(); return; }
  const { tokens } = await api("/api/tokenize", { prompt: $("prompt").value });
  state.tokens = tokens;
  drawTokens();
}

function drawTokens() {
  const edited = state.edit && $("edit-toggle").checked ? new Set(state.edit.positions) : new Set();
  const chips = state.tokens.map((tok, pos) => {
    const chip = el("span", "chip", shown(tok.text));
    chip.dataset.pos = String(pos);
    if (state.span && pos >= state.span[0] && pos < state.span[1]) chip.classList.add("picked");
    if (edited.has(pos)) chip.classList.add("edited");
    chip.addEventListener("click", () => pickToken(pos));
    return chip;
  });
  $("edit-tokens").replaceChildren(...chips);
}

function pickToken(pos) {
  const span = state.span;
  if (span && pos === span[1]) state.span = [span[0], pos + 1]; // extend to the right
  else if (span && pos === span[0] - 1) state.span = [pos, span[1]]; // extend to the left
  else if (span && pos >= span[0] && pos < span[1]) state.span = null; // click inside: unpick
  else state.span = [pos, pos + 1];
  $("edit-source").value = state.span ? state.tokens.slice(state.span[0], state.span[1]).map((t) => t.text).join("").trim() : "";
  drawTokens();
}

$("edit-source").addEventListener("input", () => { state.span = null; drawTokens(); });
$("prompt").addEventListener("input", () => { state.span = null; state.edit = null; });

function editRequest() {
  const layers = [...document.querySelectorAll("#edit-layers input")].filter((b) => b.checked).map((b) => Number(b.value));
  return {
    ...sampling(), target: $("edit-target").value, source: $("edit-source").value,
    span: state.span, strategy: $("edit-strategy").value, pad: $("edit-pad").value,
    rows: $("edit-rows").value, layers: state.info && state.info.table_layers.length ? layers : null, show_top: 8,
  };
}

// The one top-k table: the shown side's most likely next tokens, each with its probability before and with
// the edit (bars scaled to the table's largest) and the change the edit makes.
function probCell(p, scale) {
  const cell = el("td", "prob");
  const bar = el("span", "bar");
  bar.style.width = `${Math.round((100 * p) / scale)}%`;
  const track = el("span", "track");
  track.append(bar);
  cell.append(track, el("span", "num", prob(p)));
  return cell;
}

function drawTop(box, top, editedSide) {
  const table = el("table", "top-table");
  const head = el("tr");
  for (const h of ["token", "before", "with edit", "change"]) head.append(el("th", "", h));
  table.append(head);
  const scale = Math.max(...top.map((t) => Math.max(t.prob, t.other_prob)));
  for (const t of top) {
    const [before, after] = editedSide ? [t.other_prob, t.prob] : [t.prob, t.other_prob];
    const change = after - before;
    const tr = el("tr");
    tr.append(el("td", "tok", shown(t.token)), probCell(before, scale), probCell(after, scale));
    tr.append(el("td", `num delta ${change > 0 ? "up" : change < 0 ? "down" : ""}`, `${change >= 0 ? "+" : "−"}${prob(Math.abs(change))}`));
    table.append(tr);
  }
  box.replaceChildren(table);
}

function drawEdit() {
  const result = state.edit;
  if (!result) return;
  const on = $("edit-toggle").checked;
  const side = on ? result.after : result.before;
  $("edit-toggle-label").textContent = on ? "edit on" : "edit off";
  const out = $("edit-output");
  out.replaceChildren(el("span", "prompt-text", $("prompt").value), el("span", "completion", side.text));
  out.dataset.state = on ? "on" : "off";
  $("before-text").textContent = result.before.text;
  $("after-text").textContent = result.after.text;
  $("edit-top-title").textContent = `Next token: the ${side.top.length} most likely ${on ? "with the edit" : "before it"}`;
  drawTop($("edit-top"), side.top, on);
  drawTokens();
}

$("edit-btn").addEventListener("click", () => withBusy($("edit-btn"), async () => {
  await refreshTokens();
  const request = editRequest();
  const result = await api("/api/edit", request);
  state.edit = result;
  state.tokens = result.tokens;
  $("edit-summary").textContent = editSummary(result, request.target.trim());
  $("edit-toggle").disabled = false;
  $("edit-toggle").checked = true;
  drawEdit();
}));
$("edit-toggle").addEventListener("change", drawEdit);

// "a, b and c"
function inWords(items) {
  return items.length < 2 ? items.join("") : `${items.slice(0, -1).join(", ")} and ${items[items.length - 1]}`;
}

// The edit in words: whose rows went where, e.g. "Rows of Germany at Spain's 2 tokens (positions 3 and 4),
// STEM layers 1 and 3; …".
function editSummary(result, target) {
  const source = result.positions.map((p) => result.tokens[p].text).join("").trim();
  const n = result.positions.length;
  const plural = (word, count) => `${word}${count === 1 ? "" : "s"}`;
  const parts = [];
  if (result.layers.length) parts.push(`${plural("STEM layer", result.layers.length)} ${inWords(result.layers.map(String))}`);
  if (result.embed) parts.push("the token embedding");
  return (
    `Rows of ${target} at ${source}'s ${n === 1 ? "token" : `${n} tokens`} ` +
    `(${plural("position", n)} ${inWords(result.positions.map(String))}), ${inWords(parts)}; ` +
    `the largest change in a next-token probability is ${result.max_abs_prob_change.toFixed(4)}.`
  );
}

// ----- save: the CLI's rule (edit --save): tokens other words share are saved only once the user confirms -----
function drawChangedTokens(changed) {
  const items = changed.map((t) => {
    const item = el("li", "", `'${t.token}' (id ${t.id}): `);
    const words = t.shared_with;
    if (!words.length) { item.append("no other word"); return item; }
    item.append(el("span", "shared", `also in ${words.length} word${words.length > 1 ? "s" : ""}: ${words.slice(0, SHOWN_WORDS).join(", ")}`));
    if (words.length > SHOWN_WORDS) {
      const more = el("details", "more");
      more.append(el("summary", "", `${words.length - SHOWN_WORDS} more`), el("div", "", words.slice(SHOWN_WORDS).join(", ")));
      item.append(more);
    }
    return item;
  });
  $("save-tokens").replaceChildren(...items);
  $("save-tokens").hidden = false;
}

async function save(request) {
  $("save-confirm").hidden = true;
  state.pendingSave = null;
  $("save-status").textContent = "";
  $("save-tokens").hidden = true;
  let result;
  try {
    result = await api("/api/save", request);
  } catch (err) {
    if (!err.data || !err.data.changed_tokens) throw err;
    drawChangedTokens(err.data.changed_tokens); // refused: show what would change and ask
    state.pendingSave = { ...request, allow_shared_subwords: true };
    $("save-status").textContent = "not saved yet: other words share tokens this edit rewrites everywhere";
    $("save-confirm").hidden = false;
    return;
  }
  drawChangedTokens(result.edit.changed_tokens);
  $("save-status").textContent = `saved ${result.path}`;
}

$("save-btn").addEventListener("click", () => withBusy($("save-btn"), async () => {
  const name = $("save-name").value.trim() || `${$("edit-source").value}-to-${$("edit-target").value}`.replace(/[^A-Za-z0-9._-]+/g, "-");
  await save({ ...editRequest(), name, allow_shared_subwords: false });
}));
$("save-confirm-btn").addEventListener("click", () => withBusy($("save-confirm-btn"), () => save(state.pendingSave)));
$("save-cancel-btn").addEventListener("click", () => {
  state.pendingSave = null;
  $("save-confirm").hidden = true;
  $("save-status").textContent = "not saved";
});

$("error-close").addEventListener("click", clearError);
loadInfo().catch((err) => showError(err.message));
