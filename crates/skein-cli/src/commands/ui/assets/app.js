// The page of `skein ui`. It reads everything from the JSON API under /api and builds the
// document with DOM calls: every text that came from a model, a tool or a person goes in
// as text (textContent / text nodes), never as markup.
"use strict";

const S = { csrf: "", info: null, source: null, refresh: null, view: null };

// ---- DOM helpers ------------------------------------------------------------------

// el("div", {class: "x", onclick: f}, "text", child, …): strings become text nodes.
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(e.dataset, v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const k of kids.flat()) {
    if (k === null || k === undefined || k === false) continue;
    e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return e;
}

function main(...kids) {
  const m = document.getElementById("main");
  m.replaceChildren(...kids);
}

const enc = encodeURIComponent;
const fmtMs = (ms) => (ms < 1000 ? `${ms}ms` : ms < 60000 ? `${(ms / 1000).toFixed(1)}s` : `${Math.floor(ms / 60000)}m${Math.round((ms % 60000) / 1000)}s`);
const fmtTime = (t) => (t ? new Date(t).toLocaleString() : "");
const tokens = (u) => (u ? (u.input_tokens || 0) + (u.output_tokens || 0) : 0);
const cost = (u) => `$${((u && u.cost) || 0).toFixed(4)}`;
const badge = (status) => el("span", { class: `badge s-${status}` }, status.replace(/_/g, " "));

// ---- API ----------------------------------------------------------------------------

async function api(path, body) {
  const opts = { credentials: "same-origin", headers: {} };
  if (body !== undefined) {
    opts.method = "POST";
    opts.headers["content-type"] = "application/json";
    opts.headers["x-skein-csrf"] = S.csrf;
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(`/api${path}`, opts);
  if (r.status === 401 && path !== "/login") {
    showLogin();
    throw new Error("this server needs its token");
  }
  if (r.status === 204) return null;
  const j = await r.json().catch(() => ({ error: r.statusText }));
  if (!r.ok) throw new Error(j.error || r.statusText);
  return j;
}

// A page of a list: its rows and the cursor of the next page, from the response header
// `x-skein-next-cursor` (none on the last page).
async function apiPage(path) {
  const r = await fetch(`/api${path}`, { credentials: "same-origin" });
  if (r.status === 401) {
    showLogin();
    throw new Error("this server needs its token");
  }
  const j = await r.json().catch(() => ({ error: r.statusText }));
  if (!r.ok) throw new Error(j.error || r.statusText);
  return { rows: j, next: r.headers.get("x-skein-next-cursor") };
}

function showLogin() {
  const input = el("input", { type: "password", id: "token", placeholder: "token", autocomplete: "current-password" });
  const msg = el("p", { class: "error" });
  const form = el("form", {
    class: "card", onsubmit: async (e) => {
      e.preventDefault();
      try { await api("/login", { token: input.value }); await boot(); } catch (err) { msg.textContent = err.message; }
    },
  }, el("h2", {}, "This server needs its token"), input, el("button", { type: "submit" }, "Log in"), msg);
  main(form);
}

// ---- live feed ----------------------------------------------------------------------

// Follows the live feed (of one tree, or every tree); `onEvent` is called, a little
// later and once for a burst, when events were appended; `onText` for streamed text.
function follow(root, onEvent, onText) {
  if (S.source) S.source.close();
  // A refresh still pending from the view before would run that view's reader and
  // swallow this view's refreshes.
  if (S.refresh) { clearTimeout(S.refresh); S.refresh = null; }
  const dot = document.getElementById("live");
  const src = new EventSource(`/api/live${root ? `?root=${enc(root)}` : ""}`);
  S.source = src;
  let pending = [];
  const kick = (item) => {
    if (item) pending.push(item);
    if (S.refresh) return;
    S.refresh = setTimeout(() => { S.refresh = null; const p = pending; pending = []; onEvent(p); }, 250);
  };
  // Once the feed is open, the page is read again: what was appended between the first
  // read and the subscription is not missed.
  src.addEventListener("open", () => { dot.classList.replace("off", "on"); kick(null); });
  src.addEventListener("error", () => dot.classList.replace("on", "off"));
  src.addEventListener("event", (e) => kick(JSON.parse(e.data)));
  src.addEventListener("lagged", () => kick(null));
  if (onText) src.addEventListener("text", (e) => onText(JSON.parse(e.data)));
}

// ---- the inbox ----------------------------------------------------------------------

function inboxItem(it, done) {
  const msg = el("p", { class: "error" });
  const fail = (e) => { msg.textContent = e.message; };
  if (it.kind === "question") {
    const inputs = it.questions.map((q) => {
      const d = it.proposed_defaults && it.proposed_defaults[q.key];
      return el("label", {}, el("span", {}, q.question),
        el("input", { name: q.key, class: "answer-input", placeholder: d === undefined ? "" : String(d) }));
    });
    const form = el("form", {
      class: "card question", onsubmit: async (e) => {
        e.preventDefault();
        const answers = {};
        for (const l of inputs) {
          const i = l.querySelector("input");
          answers[i.name] = i.value === "" && i.placeholder !== "" ? i.placeholder : i.value;
        }
        try { await api("/answer", { token: it.token, answers }); done(); } catch (err) { fail(err); }
      },
    },
    el("h3", {}, "Question from ", el("a", { href: `#/session/${enc(it.session)}` }, it.session), ` (${it.agent})`),
    it.context ? el("p", { class: "context" }, it.context) : null,
    inputs, el("button", { type: "submit", class: "answer" }, "Answer"), msg);
    return form;
  }
  const reason = el("input", { name: "reason", placeholder: "reason (optional)" });
  const decide = (approved) => async () => {
    try { await api("/approve", { token: it.token, approved, reason: reason.value || null }); done(); } catch (err) { fail(err); }
  };
  return el("div", { class: "card approval" },
    el("h3", {}, "Approval for ", el("code", { class: "tool" }, it.tool || "?"), " in ",
      el("a", { href: `#/session/${enc(it.session)}` }, it.session), ` (${it.agent})`),
    el("p", { class: "muted" }, "The call's whole arguments, as they would run:"),
    el("pre", { class: "args" }, it.preview || ""),
    reason,
    el("div", { class: "buttons" },
      el("button", { class: "approve", onclick: decide(true) }, "Approve"),
      el("button", { class: "deny", onclick: decide(false) }, "Deny")),
    msg);
}

// Reads the inbox into `holder`. A card still waiting keeps its element, so a live
// refresh never wipes an answer being typed or moves the focus out of it.
async function fillInbox(holder, root, refresh, stale) {
  if (!S.info.writable) return;
  const items = await api(`/inbox${root ? `?root=${enc(root)}` : ""}`);
  if (stale && stale()) return;
  const keys = items.map((it) => it.token).join("\n");
  if (holder.dataset.keys === keys) return;
  const kept = holder.cards || new Map();
  const cards = new Map(items.map((it) => [it.token, kept.get(it.token) || inboxItem(it, refresh)]));
  holder.cards = cards;
  holder.dataset.keys = keys;
  if (items.length === 0) holder.replaceChildren();
  else holder.replaceChildren(el("section", { id: "inbox" }, el("h2", {}, "Waiting for you"), ...cards.values()));
}

// ---- the sessions list --------------------------------------------------------------

const SINCE = { "": 0, "1h": 3600e3, "24h": 86400e3, "7d": 7 * 86400e3 };

async function sessionsView() {
  const view = Symbol("sessions");
  S.view = view;
  const params = new URLSearchParams(location.hash.split("?")[1] || "");
  const f = {
    status: el("select", { name: "status" }, ["", "running", "waiting", "awaiting_input", "awaiting_approval", "completed", "failed", "cancelled"].map((s) => el("option", { value: s }, s ? s.replace(/_/g, " ") : "any status"))),
    agent: el("select", { name: "agent" }, el("option", { value: "" }, "any agent"), S.info.agents.map((a) => el("option", { value: a.name }, a.name))),
    since: el("select", { name: "since" }, Object.keys(SINCE).map((k) => el("option", { value: k }, k ? `last ${k}` : "any time"))),
    q: el("input", { name: "q", type: "search", placeholder: "search missions" }),
  };
  for (const [k, e] of Object.entries(f)) e.value = params.get(k) || "";
  const list = el("div", { id: "sessions" });
  const pager = el("p", { class: "pager" });
  const inbox = el("div");
  // The cursors of the pages shown before this one (the first page's is empty).
  const pages = [""];
  // Reads overlap (the live feed's re-read, a page turned, a filter typed): only the
  // latest renders, so an older page answered last cannot replace the filtered one.
  let latest = 0;
  const load = async () => {
    if (S.view !== view) return;
    const gen = ++latest;
    const q = new URLSearchParams();
    if (f.status.value) q.set("status", f.status.value);
    if (f.agent.value) q.set("agent", f.agent.value);
    if (f.since.value) q.set("since", String(Date.now() - SINCE[f.since.value]));
    if (f.q.value) q.set("q", f.q.value);
    // Rows a page (`#/?limit=N`; the server's default otherwise).
    if (Number(params.get("limit")) > 0) q.set("limit", params.get("limit"));
    const cursor = pages[pages.length - 1];
    if (cursor) q.set("cursor", cursor);
    const { rows, next } = await apiPage(`/sessions?${q}`);
    if (gen !== latest || S.view !== view) return;
    const turn = (e, to) => { e.preventDefault(); to(); load(); };
    // `replaceChildren` would print a null as the text "null": the links go in a span.
    pager.replaceChildren(el("span", {},
      pages.length > 1 ? el("a", { href: "#/", id: "newest-page", onclick: (e) => turn(e, () => pages.splice(1)) }, "« newest") : null,
      pages.length > 1 && next ? " · " : null,
      next ? el("a", { href: "#/", id: "next-page", onclick: (e) => turn(e, () => pages.push(next)) }, "older »") : null));
    list.replaceChildren(rows.length === 0 ? el("p", { class: "muted" }, "No trees match.") :
      el("div", { class: "table" }, el("table", {},
        el("thead", {}, el("tr", {}, ["tree", "agent", "status", "started", "wall", "tokens", "mission"].map((h) => el("th", {}, h)))),
        el("tbody", {}, rows.map((r) => el("tr", {},
          el("td", {}, el("a", { href: `#/tree/${enc(r.session)}`, class: "root-link" }, r.session)),
          el("td", {}, r.agent), el("td", {}, badge(r.status)), el("td", {}, fmtTime(r.started_at)),
          el("td", {}, fmtMs(r.wall_ms)), el("td", {}, tokens(r.usage_total)),
          el("td", { class: "mission" }, r.mission.length > 120 ? `${r.mission.slice(0, 120)}…` : r.mission)))))));
    await fillInbox(inbox, null, load);
  };
  // A changed filter starts again from the newest page.
  const refilter = () => { pages.splice(1); load(); };
  const filters = el("form", {
    class: "filters", onsubmit: (e) => { e.preventDefault(); refilter(); },
    onchange: () => refilter(), oninput: (e) => { if (e.target === f.q) refilter(); },
  }, f.status, f.agent, f.since, f.q);
  main(inbox, startForm(), el("h2", {}, "Trees"), filters, list, pager);
  await load();
  follow(null, load);
}

function startForm() {
  if (!S.info.writable) {
    return el("p", { class: "muted" }, `Read-only: ${S.info.read_only_reason || ""}`);
  }
  const agent = el("select", { name: "agent", id: "start-agent" }, S.info.agents.map((a) => el("option", { value: a.name, title: a.description }, a.name)));
  const orch = S.info.agents.find((a) => a.name === "orchestrator");
  if (orch) agent.value = orch.name;
  const mission = el("textarea", { name: "mission", id: "start-mission", rows: 2, placeholder: "What should the root agent do?" });
  const id = el("input", { name: "id", id: "start-id", placeholder: "id (optional)" });
  const msg = el("p", { class: "error" });
  return el("details", { class: "card start" }, el("summary", {}, "Start a tree"),
    el("form", {
      onsubmit: async (e) => {
        e.preventDefault();
        try {
          const r = await api("/sessions", { agent: agent.value, mission: mission.value, id: id.value || null });
          location.hash = `#/tree/${enc(r.session)}`;
        } catch (err) { msg.textContent = err.message; }
      },
    }, agent, mission, id, el("button", { type: "submit", id: "start" }, "Start"), msg));
}

// ---- one tree ---------------------------------------------------------------------

async function treeView(root) {
  const view = Symbol("tree");
  S.view = view;
  const head = el("div");
  const tree = el("section", { id: "tree" });
  const timeline = el("section", { id: "timeline" });
  const inbox = el("div");
  const plan = el("section", { id: "plan" });
  const answer = el("section", { id: "result" });
  // Reads may overlap (a burst of events during a slow read): only the latest one
  // renders, so an older read finishing last cannot leave the page stale.
  let latest = 0;
  const load = async () => {
    if (S.view !== view) return;
    const gen = ++latest;
    const t = await api(`/trees/${enc(root)}`);
    if (gen !== latest) return;
    const rows = t.sessions;
    const r0 = rows[0];
    const s = t.summary;
    const ended = ["completed", "failed", "cancelled"].includes(r0.status);
    const cancelMsg = el("span", { class: "error", id: "cancel-msg" });
    const cancelBtn = !ended && S.info.writable ? el("button", {
      class: "deny", id: "cancel", type: "button", onclick: async () => {
        if (!confirm(`Cancel ${t.root} and every session under it?`)) return;
        cancelBtn.disabled = true;
        try { await api(`/trees/${enc(root)}/cancel`, {}); await load(); } catch (err) { cancelMsg.textContent = err.message; cancelBtn.disabled = false; }
      },
    }, "Cancel the tree") : null;
    head.replaceChildren(
      el("h1", {}, "Tree ", el("code", {}, t.root), " ", badge(r0.status), " ", cancelBtn, cancelMsg),
      el("p", { class: "mission" }, r0.mission),
      el("p", { class: "summary" },
        `${s.sessions} sessions · ${s.steps} model turns · ${s.tool_calls} tool calls · ${tokens(s.usage)} tokens · ${cost(s.usage)} · ${s.cache_hits} cache hits · ${fmtMs(s.wall_ms)}`),
      ...((t.waiting_for_room || []).length ? [el("p", { class: "error", id: "waiting-for-room" },
        `${t.waiting_for_room.length} session(s) wait for room in the store and run on once there is room: ${t.waiting_for_room[0].reason}`)] : []),
      ...((t.waiting_for_quota || []).length ? [el("p", { class: "waiting", id: "waiting-for-quota" },
        `${t.waiting_for_quota.length} session(s) waiting: ${t.waiting_for_quota[0].reason}`)] : []),
      el("p", { class: "links" },
        el("a", { href: `/api/trees/${enc(root)}/audit`, download: `${root}.audit.jsonl`, id: "audit" }, "Download the audit export"),
        " · ", el("a", { href: `#/session/${enc(root)}` }, "root's log")));
    await fillInbox(inbox, root, load, () => gen !== latest);
    if (gen !== latest) return;
    // The tree, nested by depth.
    const byParent = new Map();
    for (const r of rows) {
      const p = r.session.includes("/") ? r.session.slice(0, r.session.lastIndexOf("/")) : "";
      if (!byParent.has(p)) byParent.set(p, []);
      byParent.get(p).push(r);
    }
    const branch = (parent) => el("ul", {}, (byParent.get(parent) || []).map((r) => el("li", {},
      el("div", { class: "node" },
        el("a", { href: `#/session/${enc(r.session)}`, class: "session-link", dataset: { session: r.session } }, r.session.split("/").pop()),
        " ", el("span", { class: "agent" }, r.agent), r.via ? el("span", { class: "via muted" }, ` via ${r.via}`) : null, " ", badge(r.status),
        el("span", { class: "stats" }, `${r.steps} turns · ${r.tool_calls} tools · ${tokens(r.usage)} tok · ${cost(r.usage)}${r.cache_hits ? ` · ${r.cache_hits} cached` : ""}`)),
      byParent.has(r.session) ? branch(r.session) : null)));
    tree.replaceChildren(el("h2", {}, "Sessions"), branch(""));
    const chart = await gantt(root);
    if (gen !== latest) return;
    timeline.replaceChildren(el("h2", {}, "Timeline"), chart);
    plan.replaceChildren();
    if (t.plan && t.plan.tasks && t.plan.tasks.length) {
      const p = await api(`/sessions/${enc(root)}/plan`);
      if (gen !== latest) return;
      plan.append(el("h2", {}, "Plan"), el("pre", { class: "plan" }, p.markdown));
    }
    answer.replaceChildren();
    if (r0.answer !== null && r0.answer !== undefined) answer.append(el("h2", {}, "Answer"), el("div", { class: "answer-text", id: "answer" }, r0.answer));
    if (r0.error) answer.append(el("h2", {}, "Error"), el("div", { class: "error-text" }, r0.error));
  };
  main(head, inbox, tree, timeline, answer, plan);
  await load();
  follow(root, load);
}

async function gantt(root) {
  const rows = await api(`/trees/${enc(root)}/timeline`);
  const t0 = Math.min(...rows.map((r) => r.start));
  const t1 = Math.max(...rows.map((r) => r.end), t0 + 1);
  const pct = (t) => `${(((t - t0) / (t1 - t0)) * 100).toFixed(2)}%`;
  const width = (a, b) => `max(2px, ${(((b - a) / (t1 - t0)) * 100).toFixed(2)}%)`;
  return el("div", { class: "gantt" },
    el("div", { class: "gantt-scale" }, el("span", {}, "0"), el("span", {}, fmtMs(t1 - t0))),
    rows.map((r) => {
      const tok = r.steps.reduce((n, s) => n + s.input_tokens + s.output_tokens, 0);
      const cached = r.steps.reduce((n, s) => n + s.cache_read_tokens, 0);
      const usd = r.steps.reduce((n, s) => n + s.cost, 0);
      const bar = el("div", { class: `bar s-${r.status}` });
      bar.style.left = pct(r.start);
      bar.style.width = width(r.start, r.end);
      const lane = el("div", { class: "lane" }, bar, r.steps.map((s) => {
        const seg = el("div", {
          class: `step k-${s.kind}${s.error ? " err" : ""}`,
          title: `${s.kind} ${s.name} · ${fmtMs(s.end - s.start)} · ${s.input_tokens}+${s.output_tokens} tokens · $${s.cost.toFixed(4)}${s.cache_read_tokens ? ` · ${s.cache_read_tokens} from the prompt cache` : ""}`,
        });
        seg.style.left = pct(s.start);
        seg.style.width = width(s.start, s.end);
        return seg;
      }));
      const label = el("a", { class: "gantt-label", href: `#/session/${enc(r.session)}` }, r.session.split("/").pop());
      label.style.paddingLeft = `${r.depth}rem`;
      return el("div", { class: "gantt-row" },
        label,
        lane,
        el("span", { class: "gantt-stats" }, `${tok} tok · $${usd.toFixed(4)}${cached ? ` · ${cached} cached` : ""}`));
    }),
    el("p", { class: "legend" }, el("span", { class: "step k-model" }), " model ", el("span", { class: "step k-tool" }), " tool ",
      el("span", { class: "step k-cache" }), " cache hit ", el("span", { class: "step k-wait" }), " waiting for a person"));
}

// ---- one session --------------------------------------------------------------------

function messageView(m) {
  const role = m.role;
  const body = [];
  if (role === "assistant") {
    if (m.content) body.push(el("div", { class: "text" }, m.content));
    for (const c of m.tool_calls || []) body.push(el("div", { class: "call" }, el("code", {}, `${c.name}#${c.id}`), " ", el("code", { class: "args" }, JSON.stringify(c.args))));
  } else if (role === "tool") {
    body.push(el("div", { class: "call" }, el("code", {}, `${m.name}#${m.call_id}`), m.is_error ? el("span", { class: "badge s-failed" }, "error") : null));
    body.push(el("div", { class: "text" }, m.content));
  } else {
    body.push(el("div", { class: "text" }, m.content));
  }
  return el("li", { class: `msg r-${role}` }, el("span", { class: "role" }, role), ...body);
}

function slotState(s) {
  switch (s.state) {
    case "delegated": return `waiting for ${String(s.child).replace(/\./g, "/")}`;
    case "asked": return "waiting for an answer";
    case "awaiting_approval": return "waiting for approval";
    case "done": return s.error ? "done (error)" : "done";
    default: return s.state.replace(/_/g, " ");
  }
}

function stateView(v) {
  const st = v.state;
  const parts = [
    el("p", { class: "summary", id: "state-summary" }, badge(st.status), ` at seq ${v.at} of ${v.last_seq} · ${st.steps} model turns · ${tokens(st.usage_own)} tokens own · ${cost(st.usage_own)}`),
    el("h3", {}, `Messages (${st.transcript.length})`),
    el("ol", { class: "messages", id: "messages" }, st.transcript.map(messageView)),
  ];
  if (st.turn && st.turn.length) {
    parts.push(el("h3", {}, "Calls of the current turn"), el("ul", { class: "pending", id: "pending" },
      st.turn.map((s) => el("li", {}, el("code", {}, `${s.call.name}#${s.call.id}`), ` ${slotState(s.state)}`))));
  }
  const children = Object.values(st.children || {});
  if (children.length) {
    parts.push(el("h3", {}, "Children"), el("ul", {}, children.map((c) => {
      const id = String(c.child).replace(/\./g, "/");
      return el("li", {}, el("a", { href: `#/session/${enc(id)}` }, id), ` (${c.agent}) ${c.outcome || "running"}${c.cached ? " [cache]" : ""}`);
    })));
  }
  if (st.plan && st.plan.tasks && st.plan.tasks.length) {
    parts.push(el("h3", {}, `Plan v${st.plan.version}`), el("ul", { class: "plan-tasks" }, st.plan.tasks.map((t) => el("li", {}, `[${t.status}] ${t.id}: ${t.title}`))));
  }
  if (st.answer !== null && st.answer !== undefined) parts.push(el("h3", {}, "Answer"), el("div", { class: "answer-text" }, st.answer));
  if (st.error) parts.push(el("h3", {}, "Error"), el("div", { class: "error-text" }, st.error));
  return parts;
}

async function sessionView(id) {
  const view = Symbol("session");
  S.view = view;
  const root = id.split("/")[0];
  const head = el("div");
  const verdict = el("p", { id: "verdict", class: "muted" }, "checking the log…");
  const slider = el("input", { type: "range", id: "seq", min: 1, max: 1, value: 1, step: 1 });
  const label = el("span", { id: "seq-label" });
  const forkMsg = el("span", { class: "error" });
  const forkBtn = el("button", {
    id: "fork", onclick: async () => {
      try { const r = await api(`/sessions/${enc(id)}/fork`, { at: Number(slider.value) }); location.hash = `#/tree/${enc(r.session)}`; } catch (err) { forkMsg.textContent = err.message; }
    },
  }, "Fork from this seq");
  const state = el("div", { id: "state" });
  const streaming = el("pre", { id: "streaming", class: "streaming", hidden: true });
  const log = el("div", { id: "log", class: "table" });
  const plan = el("section", { id: "plan-history" });
  let last = 0;
  let shown = 0;
  const showState = async (at) => {
    const v = await api(`/sessions/${enc(id)}/state?at=${at}`);
    if (S.view !== view || Number(slider.value) !== at) return;
    shown = at;
    label.textContent = `seq ${at} of ${v.last_seq}`;
    state.replaceChildren(...stateView(v));
    for (const tr of log.querySelectorAll("tr[data-seq]")) tr.classList.toggle("at", Number(tr.dataset.seq) === at);
  };
  slider.addEventListener("input", () => showState(Number(slider.value)));
  let latest = 0;
  const load = async () => {
    if (S.view !== view) return;
    const gen = ++latest;
    const events = await api(`/sessions/${enc(id)}/events`);
    if (gen !== latest || S.view !== view) return;
    const follow = Number(slider.value) === last;
    const first = events[0].body.data || {};
    last = events[events.length - 1].seq;
    head.replaceChildren(
      el("h1", {}, "Session ", el("code", {}, id)),
      el("p", {}, el("a", { href: `#/tree/${enc(root)}` }, `← tree ${root}`), " · agent ", el("strong", {}, first.agent || "?")),
      el("p", { class: "mission" }, first.mission || ""));
    slider.max = String(last);
    if (follow || shown === 0) slider.value = String(last);
    log.replaceChildren(el("table", {},
      el("thead", {}, el("tr", {}, el("th", {}, "seq"), el("th", {}, "kind"), el("th", {}, "event"))),
      el("tbody", {}, events.map((e) => el("tr", {
        dataset: { seq: e.seq }, class: e.seq === Number(slider.value) ? "at" : null,
        onclick: () => { slider.value = String(e.seq); showState(e.seq); },
      }, el("td", {}, e.seq), el("td", {}, e.kind),
      el("td", {}, el("details", {}, el("summary", {}, e.line), el("pre", {}, JSON.stringify(e.body, null, 2)))))))));
    if (Number(slider.value) !== shown || follow) await showState(Number(slider.value));
    const p = await api(`/sessions/${enc(id)}/plan`);
    plan.replaceChildren();
    if (p.changes.length) {
      plan.append(el("h2", {}, "Plan changes"), el("ul", {}, p.changes.map((c) => el("li", { class: c.kind === "PatchApplied" ? "applied" : "rejected" },
        `seq ${c.seq}: `, c.kind === "PatchApplied" ? `applied → v${c.version} ` : "rejected ", `by ${c.agent} (${c.from})`,
        c.reason ? `: ${c.reason}` : "", c.ops && c.ops.length ? el("pre", {}, JSON.stringify(c.ops, null, 2)) : null))));
    }
    const v = await api(`/sessions/${enc(id)}/verify`);
    const s = v.sessions[0];
    verdict.className = v.ok ? "ok" : "error";
    verdict.textContent = v.ok ? `replay --verify: ok (${s ? s.events : 0} events: chain intact, every decision reproduced)` : `replay --verify: FAIL at seq ${s && s.seq}: ${s && s.problem}`;
  };
  const onText = (t) => {
    if (t.session !== id) return;
    streaming.hidden = false;
    streaming.textContent = (streaming.textContent + t.text).slice(-4000);
  };
  main(head, verdict,
    el("section", { class: "card replay" }, el("h2", {}, "State at a seq"),
      el("div", { class: "slider" }, slider, label), S.info.writable ? el("div", {}, forkBtn, forkMsg) : null, state),
    streaming, plan, el("h2", {}, "Log"), log);
  await load();
  follow(root, (items) => {
    if (items.some((i) => i.session === id && i.kind === "ModelCalled")) { streaming.textContent = ""; streaming.hidden = true; }
    if (items.length === 0 || items.some((i) => i.session === id)) load();
  }, onText);
}

// ---- routing ------------------------------------------------------------------------

async function route() {
  const h = location.hash || "#/";
  const [path] = h.slice(1).split("?");
  try {
    if (path.startsWith("/tree/")) await treeView(decodeURIComponent(path.slice(6)));
    else if (path.startsWith("/session/")) await sessionView(decodeURIComponent(path.slice(9)));
    else await sessionsView();
  } catch (err) {
    if (!document.getElementById("token")) main(el("p", { class: "error" }, err.message));
  }
}

async function boot() {
  // Opened with the URL the server printed (`/?token=…`): log in with the token, then take
  // it out of the address bar and the history.
  const given = new URLSearchParams(location.search).get("token");
  if (given) {
    history.replaceState(null, "", location.pathname + location.hash);
    try { await api("/login", { token: given }); } catch (err) { showLogin(); return; }
  }
  S.info = await api("/info");
  S.csrf = S.info.csrf;
  document.getElementById("backend").textContent = `${S.info.backend}${S.info.writable ? "" : " · read-only"}`;
  await route();
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", () => { boot().catch((err) => { if (!document.getElementById("token")) main(el("p", { class: "error" }, err.message)); }); });
