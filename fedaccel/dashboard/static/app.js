// fedaccel dashboard: one page, six views (#/, #/run/<id>, #/study/<id>, #/compare,
// #/launch, #/launch-study), drawn from the JSON API; live updates from
// Server-Sent Events (/api/events).
"use strict";

const view = document.getElementById("view");
let runs = [];            // the latest overview of every run (from /api/events)
let studies = [];         // the latest overview of every study (fedaccel-sweep folders)
let current = null;       // {name, id} of the view on screen
let schemaCache = null;

// ------------------------------------------------------------------ helpers
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(2) + " %");
const secs = (s) => {
  if (s === null || s === undefined) return "–";
  if (s < 90) return s.toFixed(s < 10 ? 2 : 0) + " s";
  if (s < 5400) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
};
async function api(path, body) {
  const opts = body === undefined ? {} : {
    method: "POST", body: JSON.stringify(body),
    headers: {"Content-Type": "application/json", "X-Fedaccel": "1"},
  };
  const res = await fetch(path, opts);
  const data = await res.json().catch(() => ({error: res.statusText}));
  if (!res.ok) { const e = new Error(data.error || res.statusText); e.key = data.key; throw e; }
  return data;
}
const badge = (state) => el("span", {class: "state state-" + state}, state);
function parseHash() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  return {path: path || "/", params: new URLSearchParams(query || "")};
}

// --------------------------------------------------------------- live feed
function connect() {
  const live = document.getElementById("live");
  const source = new EventSource("/api/events");
  source.addEventListener("runs", (ev) => {
    runs = JSON.parse(ev.data);
    live.textContent = "live";
    live.className = "live on";
    onRunsChanged();
  });
  source.addEventListener("studies", (ev) => {
    studies = JSON.parse(ev.data);
    if (!current) return;
    if (current.name === "runs") drawStudiesTable();
    if (current.name === "study") {
      const s = studies.find((x) => x.id === current.id);
      if (s && (s.finished !== current.finished || s.state !== current.state)) loadStudy(current.id);
    }
  });
  source.onerror = () => { live.textContent = "reconnecting…"; live.className = "live"; };
}

function onRunsChanged() {
  if (!current) return;
  if (current.name === "runs") drawRunsTable();
  if (current.name === "run") {
    const r = runs.find((x) => x.id === current.id);
    if (r && (r.round !== current.round || r.state !== current.state)) loadRun(current.id);
  }
  if (current.name === "study") {  // a cell's round changed: its row in the cells table
    const mine = runs.filter((r) => r.id.startsWith(current.id + "/cells/"));
    const key = mine.map((r) => `${r.id}:${r.round}:${r.state}`).join(",");
    if (key !== current.cellsKey) { current.cellsKey = key; loadStudy(current.id); }
  }
}

// ------------------------------------------------------------------- runs
function showRuns() {
  current = {name: "runs"};
  view.replaceChildren(
    el("h1", {}, "Runs"),
    el("div", {class: "toolbar"},
      el("button", {id: "compare-button", onclick: () => {
        const ids = [...document.querySelectorAll("input.pick:checked")].map((c) => c.value);
        location.hash = "#/compare?ids=" + ids.map(encodeURIComponent).join(",");
      }}, "Compare selected"),
      el("a", {class: "button", href: "#/launch"}, "Launch a run")),
    el("table", {id: "runs-table"},
      el("thead", {}, el("tr", {}, ["", "run", "algorithm", "dataset", "state", "round",
        "accuracy", "time / round", "ETA"].map((h) => el("th", {}, h)))),
      el("tbody")),
    el("p", {id: "runs-empty", class: "hint"}),
    el("h2", {}, "Studies (fedaccel-sweep)"),
    el("div", {class: "toolbar"}, el("a", {class: "button", href: "#/launch-study"}, "Launch a study")),
    el("table", {id: "studies-table"},
      el("thead", {}, el("tr", {}, ["study", "state", "cells finished", "running", "failed / stopped", "ETA"]
        .map((h) => el("th", {}, h)))),
      el("tbody")),
    el("p", {id: "studies-empty", class: "hint"}),
    el("h2", {}, "Flower runs"),
    el("div", {id: "flower"}, "…"));
  drawRunsTable();
  drawStudiesTable();
  loadFlower();
}

function drawStudiesTable() {
  const body = document.querySelector("#studies-table tbody");
  if (!body) return;
  const n = (s, k) => s.counts[k] || 0;
  body.replaceChildren(...studies.map((s) => el("tr", {"data-id": s.id},
    el("td", {}, el("a", {href: "#/study/" + encodeURIComponent(s.id)}, s.name)),
    el("td", {class: "state-cell"}, badge(s.state)),
    el("td", {class: "cells"}, `${s.finished} / ${s.cells}`),
    el("td", {}, n(s, "running") + n(s, "starting")),
    el("td", {}, `${n(s, "failed") + n(s, "interrupted")} / ${n(s, "stopped")}`),
    el("td", {}, secs(s.eta_seconds)))));
  document.getElementById("studies-empty").textContent = studies.length ? "" :
    "No studies yet. Launch one, or run fedaccel-sweep configs/studies/<study>.yaml.";
}

function drawRunsTable() {
  const body = document.querySelector("#runs-table tbody");
  if (!body) return;
  const picked = new Set([...document.querySelectorAll("input.pick:checked")].map((c) => c.value));
  body.replaceChildren(...runs.map((r) => el("tr", {"data-id": r.id},
    el("td", {}, el("input", {type: "checkbox", class: "pick", value: r.id, checked: picked.has(r.id)})),
    el("td", {}, el("a", {href: "#/run/" + encodeURIComponent(r.id)}, r.name)),
    el("td", {}, r.algo ?? "–"), el("td", {}, r.dataset ?? "–"),
    el("td", {class: "state-cell"}, badge(r.state)),
    el("td", {class: "round"}, `${r.round ?? 0} / ${r.rounds ?? "?"}`),
    el("td", {class: "accuracy"}, pct(r.accuracy)),
    el("td", {}, secs(r.seconds_per_round)), el("td", {}, secs(r.eta_seconds)))));
  document.getElementById("runs-empty").textContent = runs.length ? "" :
    "No runs yet under the results folders. Launch one, or run fedaccel-run / flwr run.";
}

async function loadFlower() {
  const box = document.getElementById("flower");
  try {
    const data = await api("/api/flower");
    const note = data.error || data.note;
    box.replaceChildren(
      el("p", {class: "hint"}, `SuperLink connection ${data.connection ?? "(default)"}` + (note ? `: ${note}` : "")),
      data.runs.length ? el("table", {id: "flower-table"},
        el("thead", {}, el("tr", {}, ["run id", "app", "status", "elapsed"].map((h) => el("th", {}, h)))),
        el("tbody", {}, data.runs.map((r) => el("tr", {},
          el("td", {}, r["run-id"]), el("td", {}, `${r["fab-name"]} ${r["fab-version"]}`),
          el("td", {}, r.status), el("td", {}, r.elapsed))))) : "");
  } catch (e) { box.textContent = e.message; }
}

// -------------------------------------------------------------------- run
function showRun(id) {
  current = {name: "run", id};
  view.replaceChildren(el("p", {}, "loading…"));
  loadRun(id);
}

const series = (rows, key, x = "round") => {
  const pts = rows.filter((r) => r[key] !== null && r[key] !== undefined);
  return {x: pts.map((r) => r[x]), y: pts.map((r) => r[key])};
};
const layout = (title, ytitle, xtitle = "round") => ({
  title: {text: title, font: {size: 14}, x: 0.01, xanchor: "left"}, margin: {l: 55, r: 15, t: 35, b: 40}, height: 280,
  xaxis: {title: {text: xtitle}}, yaxis: {title: {text: ytitle}}, legend: {orientation: "h", y: -0.25},
});

async function loadRun(id) {
  // live updates can overlap: only the newest request may draw (an older answer
  // arriving last would show a stale state, e.g. running after stopped)
  const seq = current.loads = (current.loads || 0) + 1;
  const mine = current;
  let d;
  try { d = await api("/api/run/" + id.split("/").map(encodeURIComponent).join("/")); }
  catch (e) { if (current === mine && mine.loads === seq) view.replaceChildren(el("p", {class: "error"}, e.message)); return; }
  if (current !== mine || mine.loads !== seq || current.name !== "run" || current.id !== id) return;
  current.round = d.round; current.state = d.state;
  const running = ["running", "starting"].includes(d.state);
  if (!document.getElementById("run-header") || current.drawn !== id) {
    current.drawn = id;
    view.replaceChildren(
      el("div", {id: "run-header"},
        el("h1", {}, d.name), el("span", {id: "run-state"}),
        el("span", {id: "run-round", class: "round"}),
        el("div", {class: "toolbar"},
          el("button", {id: "stop-button", onclick: () => stopRun(id)}, "Stop"),
          el("a", {class: "button", id: "again-button",
            href: "#/launch?from=" + encodeURIComponent(id)}, "Run again with…"))),
      el("p", {id: "run-message", class: "hint"}),
      el("p", {id: "run-error", class: "error"}),
      el("div", {class: "plots"},
        el("div", {id: "plot-accuracy", class: "plot"}), el("div", {id: "plot-loss", class: "plot"}),
        el("div", {id: "plot-bytes", class: "plot"}), el("div", {id: "plot-mb", class: "plot"})),
      el("h2", {}, "Log (last lines)"), el("pre", {id: "run-log"}),
      el("h2", {}, "Summary"), el("pre", {id: "run-summary"}),
      el("h2", {}, "Resolved config"), el("pre", {id: "run-config"}));
  }
  document.getElementById("run-state").replaceChildren(badge(d.state));
  document.getElementById("run-round").textContent =
    `round ${d.round} / ${d.rounds}` + (d.accuracy != null ? ` · accuracy ${pct(d.accuracy)}` : "") +
    (d.seconds_per_round != null ? ` · ${secs(d.seconds_per_round)} / round` : "") +
    (running && d.eta_seconds != null ? ` · ETA ${secs(d.eta_seconds)}` : "");
  document.getElementById("stop-button").disabled = !running;
  document.getElementById("run-error").textContent = d.error || "";
  const rows = d.rows || [];
  const mb = d.cumulative_mb || [];
  Plotly.react("plot-accuracy", [
    {...series(rows, "accg"), name: "accuracy (global test)", mode: "lines+markers"},
    {...series(rows, "accl"), name: "ACCL (clients' local tests)", mode: "lines+markers"},
  ], {...layout("Accuracy", "accuracy"), yaxis: {title: {text: "accuracy"}, tickformat: ".0%"}},
  {displaylogo: false, responsive: true});
  Plotly.react("plot-loss", [
    {...series(rows, "loss"), name: "test loss", mode: "lines"},
    {...series(rows, "train_loss"), name: "train loss", mode: "lines"},
  ], layout("Loss", "loss"), {displaylogo: false, responsive: true});
  Plotly.react("plot-bytes", [
    {x: rows.map((r) => r.round), y: rows.map((r) => (r.bytes_up ?? 0) / 1e6), name: "up", type: "bar"},
    {x: rows.map((r) => r.round), y: rows.map((r) => (r.bytes_down ?? 0) / 1e6), name: "down", type: "bar"},
  ], {...layout("MB per round", "MB"), barmode: "group"}, {displaylogo: false, responsive: true});
  const acc = rows.map((r, i) => [mb[i], r.accg]).filter(([, a]) => a !== null && a !== undefined);
  Plotly.react("plot-mb", [{x: acc.map((p) => p[0]), y: acc.map((p) => p[1]), name: "accuracy",
    mode: "lines"}], {...layout("Accuracy vs communication", "accuracy", "cumulative MB"),
    yaxis: {tickformat: ".0%"}}, {displaylogo: false, responsive: true});
  document.getElementById("run-log").textContent = (d.log || []).join("\n");
  document.getElementById("run-summary").textContent = d.summary ? JSON.stringify(d.summary, null, 2) : "–";
  document.getElementById("run-config").textContent = JSON.stringify(d.config, null, 2);
}

async function stopRun(id) {
  const msg = document.getElementById("run-message");
  try {
    const r = await api("/api/stop", {id});
    msg.textContent = r.message;
  } catch (e) { msg.textContent = e.message; }
}

// ------------------------------------------------------------------ study
function showStudy(id) {
  current = {name: "study", id};
  view.replaceChildren(el("p", {}, "loading…"));
  loadStudy(id);
}

const tableOf = ([header, body], id) => el("table", {id},
  el("thead", {}, el("tr", {}, header.map((h) => el("th", {}, h)))),
  el("tbody", {}, body.map((row) => el("tr", {}, row.map((c) => el("td", {}, c))))));

async function loadStudy(id) {
  let d;
  try { d = await api("/api/study/" + id.split("/").map(encodeURIComponent).join("/")); }
  catch (e) {
    if (current && current.name === "study" && current.id === id) view.replaceChildren(el("p", {class: "error"}, e.message));
    return;
  }
  if (!current || current.name !== "study" || current.id !== id) return;
  current.finished = d.finished; current.state = d.state;
  const running = d.state === "running";
  if (!document.getElementById("study-header") || current.drawn !== id) {
    current.drawn = id;
    view.replaceChildren(
      el("div", {id: "study-header"},
        el("h1", {}, d.name), el("span", {id: "study-state"}), el("span", {id: "study-progress", class: "round"}),
        el("div", {class: "toolbar"},
          el("button", {id: "study-stop", onclick: () => studyAction("/api/study/stop", {id})}, "Stop"),
          el("button", {id: "study-resume", onclick: () =>
            studyAction("/api/study/launch", {id})}, "Run the rest"))),
      el("p", {id: "study-message", class: "hint"}),
      el("p", {id: "study-error", class: "error"}),
      el("p", {id: "study-file", class: "hint"}),
      el("h2", {}, "Grouped over seeds (mean ± std, the table of fedaccel-compare --group-seeds)"),
      el("div", {id: "study-groups"}),
      el("div", {class: "plots"}, el("div", {id: "study-curves", class: "plot wide"})),
      el("h2", {}, "Cells"), el("div", {id: "study-cells"}),
      el("h2", {}, "Log (last lines)"), el("pre", {id: "study-log"}));
  }
  document.getElementById("study-error").textContent = d.error || "";
  document.getElementById("study-state").replaceChildren(badge(d.state));
  document.getElementById("study-progress").textContent = `${d.finished} of ${d.cells} cells finished` +
    (running && d.eta_seconds != null ? ` · ETA ${secs(d.eta_seconds)}` : "");
  document.getElementById("study-stop").disabled = !running;
  document.getElementById("study-resume").disabled = running || !d.study_file || d.state === "finished";
  const fileNote = document.getElementById("study-file");  // the file's name; its path on hover
  fileNote.textContent = (d.study_file ? `study file ${d.study_file.split("/").pop()}` : "") +
    (d.report.length ? ` · report/: ${d.report.join(", ")}` : "");
  fileNote.title = d.study_file || "";
  document.getElementById("study-groups").replaceChildren(d.groups_table ?
    el("div", {}, tableOf(d.groups_table, "study-groups-table"), el("p", {class: "hint"}, d.note || "")) :
    el("p", {class: "hint"}, d.error || "No cell has finished yet."));
  const traces = d.series.flatMap((s, i) => {
    const color = `hsl(${(i * 67) % 360}, 60%, 45%)`;
    const upper = s.mean.map((m, j) => m + s.std[j]), lower = s.mean.map((m, j) => m - s.std[j]);
    return [
      {x: s.rounds.concat([...s.rounds].reverse()), y: upper.concat([...lower].reverse()), fill: "toself",
       fillcolor: color.replace("hsl", "hsla").replace(")", ", 0.15)"), line: {width: 0}, hoverinfo: "skip",
       showlegend: false, name: s.label + " ± std"},
      {x: s.rounds, y: s.mean, name: `${s.label} (${s.seeds.length} seed${s.seeds.length > 1 ? "s" : ""})`,
       mode: "lines", line: {color}},
    ];
  });
  Plotly.react("study-curves", traces, {...layout("Accuracy vs round, mean over seeds (band: ± std)", "accuracy"),
    yaxis: {tickformat: ".0%"}, height: 360}, {displaylogo: false, responsive: true});
  document.getElementById("study-cells").replaceChildren(el("table", {id: "study-cells-table"},
    el("thead", {}, el("tr", {}, ["cell", "state", "round", "accuracy"].map((h) => el("th", {}, h)))),
    el("tbody", {}, d.cell_rows.map((c) => el("tr", {"data-name": c.name},
      el("td", {}, c.id ? el("a", {href: "#/run/" + encodeURIComponent(c.id)}, c.name) : c.name),
      el("td", {}, badge(c.state)), el("td", {class: "round"}, `${c.round ?? 0} / ${c.rounds ?? "?"}`),
      el("td", {}, pct(c.accuracy)))))));
  document.getElementById("study-log").textContent = (d.log || []).join("\n") || "–";
}

async function studyAction(path, body) {
  const msg = document.getElementById("study-message");
  try {
    const r = await api(path, body);
    msg.textContent = r.message || ("started: " + r.argv.join(" "));
  } catch (e) { msg.textContent = e.message; }
}

async function showLaunchStudy() {
  current = {name: "launch-study"};
  const d = await api("/api/studies");
  const file = el("select", {id: "study-file-pick"},
    d.files.map((f) => el("option", {value: f.file}, f.name)), el("option", {value: ""}, "another file…"));
  const other = el("input", {type: "text", id: "study-file-path", placeholder: "/path/to/study.yaml"});
  const workers = el("input", {type: "number", id: "study-workers", min: 1, placeholder: "one per two cores"});
  const error = el("p", {id: "study-form-error", class: "error"});
  const command = el("pre", {id: "study-command", class: "hint"});
  const body = () => ({file: file.value || other.value, workers: workers.value});
  const submit = async (go) => {
    error.textContent = ""; command.textContent = "";
    try {
      const r = await api(go ? "/api/study/launch" : "/api/study/validate", body());
      if (go) location.hash = "#/study/" + encodeURIComponent(r.id);
      else command.textContent = `${r.cells} cells, all valid, into ${r.folder}\n${r.argv.join(" ")}`;
    } catch (e) { error.textContent = e.message; }
  };
  const form = el("form", {id: "study-form", onsubmit: (ev) => { ev.preventDefault(); submit(true); }},
    el("h1", {}, "Launch a study"),
    el("p", {class: "hint"}, `A grid of fast-runner runs from one study file (fedaccel-sweep; docs/sweeps.md), ` +
      `into ${d.results_dir}. Launching a study that ran before runs only its unfinished cells.`),
    el("div", {class: "field"}, el("label", {for: "study-file-pick"}, "study file"), file,
      el("small", {}, "the project's configs/studies/, or another file")),
    el("div", {class: "field"}, el("label", {for: "study-file-path"}, "other file"), other,
      el("small", {}, "used when 'another file…' is picked")),
    el("div", {class: "field"}, el("label", {for: "study-workers"}, "workers"), workers,
      el("small", {}, "runs at once (fedaccel-sweep --workers)")),
    error, command,
    el("div", {class: "toolbar"}, el("button", {type: "button", id: "study-check", onclick: () => submit(false)},
      "Check"), el("button", {type: "submit", id: "study-launch"}, "Launch")));
  view.replaceChildren(form);
}

// ---------------------------------------------------------------- compare
async function showCompare(params) {
  current = {name: "compare"};
  const ids = (params.get("ids") || "").split(",").filter(Boolean).map(decodeURIComponent);
  const group = params.get("group") === "1";
  const recorded = runs.filter((r) => r.round > 0);
  const picker = el("select", {id: "compare-pick", multiple: true, size: Math.min(8, recorded.length + 1)},
    recorded.map((r) => el("option", {value: r.id, selected: ids.includes(r.id)}, `${r.name} (${r.algo})`)));
  const groupBox = el("input", {type: "checkbox", id: "group-seeds", checked: group});
  view.replaceChildren(
    el("h1", {}, "Compare runs"),
    el("div", {class: "toolbar"}, picker,
      el("label", {}, groupBox, " mean ± std over seeds"),
      el("button", {id: "compare-go", onclick: () => {
        const chosen = [...picker.selectedOptions].map((o) => encodeURIComponent(o.value));
        location.hash = `#/compare?ids=${chosen.join(",")}&group=${groupBox.checked ? 1 : 0}`;
      }}, "Compare")),
    el("div", {id: "compare-result"}));
  if (!ids.length) { document.getElementById("compare-result").textContent = "Pick runs to compare."; return; }
  let d;
  try { d = await api("/api/compare", {ids, group_seeds: group}); }
  catch (e) { document.getElementById("compare-result").replaceChildren(el("p", {class: "error"}, e.message)); return; }
  document.getElementById("compare-result").replaceChildren(
    el("div", {class: "plots"}, el("div", {id: "compare-rounds", class: "plot wide"}),
      el("div", {id: "compare-mb", class: "plot wide"})),
    d.groups_table ? el("h2", {}, "Grouped over seeds (mean ± std)") : "",
    d.groups_table ? tableOf(d.groups_table, "compare-groups") : "",
    el("h2", {}, "Runs"), tableOf(d.runs_table, "compare-table"), el("p", {class: "hint"}, d.note));
  const traces = (x) => d.series.map((s) => {
    const pts = s.rows.map((r, i) => [x === "round" ? r.round : s.cumulative_mb[i], r.accg])
      .filter(([, a]) => a !== null && a !== undefined);
    return {x: pts.map((p) => p[0]), y: pts.map((p) => p[1]), name: s.label, mode: "lines"};
  });
  const opts = {displaylogo: false, responsive: true};
  Plotly.react("compare-rounds", traces("round"),
    {...layout("Accuracy vs round", "accuracy"), yaxis: {tickformat: ".0%"}, height: 360}, opts);
  Plotly.react("compare-mb", traces("mb"),
    {...layout("Accuracy vs communication", "accuracy", "cumulative MB"), yaxis: {tickformat: ".0%"}, height: 360}, opts);
}

// ----------------------------------------------------------------- launch
async function showLaunch(params) {
  current = {name: "launch"};
  schemaCache = schemaCache || await api("/api/schema");
  const schema = schemaCache;
  let preset = {};
  const from = params.get("from");
  if (from) {
    try {
      const d = await api("/api/run/" + from.split("/").map(encodeURIComponent).join("/"));
      for (const f of schema.fields) if (f.key in d.config && f.key !== "run-name") preset[f.key] = d.config[f.key];
      preset.__num_clients = (d.config.resolved || {})["num-clients"];
    } catch (e) { /* the form with defaults, and the message below */ preset.__error = e.message; }
  }
  const inputs = {};
  const input = (f) => {
    const value = f.key in preset ? preset[f.key] : f.default;
    let node;
    if (f.kind === "bool") node = el("input", {type: "checkbox", checked: value === true});
    else if (f.kind === "choice") {
      node = el("select", {}, f.choices.map((c) => el("option", {value: c, selected: c === value}, c)));
    } else {  // a float keeps its decimal point: 0.0 is not the integer 0 (clients-per-round=1 vs 1.0)
      const text = f.kind === "float" && Number.isInteger(value) ? value.toFixed(1) : String(value);
      node = el("input", {type: "text", value: text});
    }
    node.id = "field-" + f.key; node.name = f.key; node.dataset.kind = f.kind;
    inputs[f.key] = node;
    return el("div", {class: "field", "data-group": f.group},
      el("label", {for: node.id}, f.key), node, el("small", {}, f.help || ""));
  };
  const groups = {};
  for (const f of schema.fields) (groups[f.group] = groups[f.group] || []).push(f);
  const engine = el("select", {id: "field-engine"}, schema.engines.map((e) =>
    el("option", {value: e}, e === "fast" ? "fast runner (fedaccel-run, this machine)" : "Flower (flwr run)")));
  const connection = el("select", {id: "field-connection"}, schema.connections.map((c) =>
    el("option", {value: c, selected: c === schema.default_connection}, c)));
  const clients = el("input", {type: "number", id: "field-num_clients", min: 1,
    value: preset.__num_clients || schema.default_num_clients});
  const error = el("p", {id: "form-error", class: "error"}, preset.__error || "");
  const command = el("pre", {id: "form-command", class: "hint"});
  const form = el("form", {id: "launch-form", onsubmit: (ev) => { ev.preventDefault(); submit(true); }},
    el("h1", {}, from ? "Run again with…" : "Launch a run"),
    el("div", {class: "field"}, el("label", {for: "field-engine"}, "where"), engine,
      el("small", {}, "the fast runner runs here, in one process; Flower runs on a SuperLink connection")),
    el("div", {class: "field flower-only"}, el("label", {for: "field-connection"}, "connection"), connection,
      el("small", {}, "SuperLink connections of Flower's config.toml (fedaccel-federations install)")),
    el("div", {class: "field fast-only"}, el("label", {for: "field-num_clients"}, "clients"), clients,
      el("small", {}, "simulated clients (fedaccel-run --num-clients)")),
    el("h2", {}, "Run"), groups.shared.map(input),
    el("h2", {}, "Algorithm hyperparameters"),
    Object.keys(groups).filter((g) => g.startsWith("algo:")).map((g) => groups[g].map(input)),
    Object.keys(groups).filter((g) => g !== "shared" && !g.startsWith("algo:")).map((g) =>
      el("details", {}, el("summary", {}, g + ".*"), groups[g].map(input))),
    error, command,
    el("div", {class: "toolbar"}, el("button", {type: "button", id: "check-button",
      onclick: () => submit(false)}, "Check"), el("button", {type: "submit", id: "launch-button"}, "Launch")));
  view.replaceChildren(form);
  const prefixOf = Object.fromEntries(schema.algorithms.map((a) => [a.name, a.prefix]));
  const refresh = () => {
    const prefix = prefixOf[inputs.algo.value];
    form.querySelectorAll(".field[data-group^='algo:']").forEach((n) => {
      n.hidden = n.dataset.group !== "algo:" + prefix;
    });
    form.querySelectorAll(".flower-only").forEach((n) => { n.hidden = engine.value !== "flower"; });
    form.querySelectorAll(".fast-only").forEach((n) => { n.hidden = engine.value !== "fast"; });
  };
  inputs.algo.addEventListener("change", refresh);
  engine.addEventListener("change", refresh);
  refresh();

  async function submit(go) {
    const prefix = prefixOf[inputs.algo.value];
    const values = {};
    for (const [key, node] of Object.entries(inputs)) {
      const group = node.closest(".field").dataset.group;
      if (group.startsWith("algo:") && group !== "algo:" + prefix) continue;  // another algorithm's
      values[key] = node.type === "checkbox" ? node.checked : node.value;
    }
    form.querySelectorAll(".invalid").forEach((n) => n.classList.remove("invalid"));
    form.querySelectorAll(".field-error").forEach((n) => n.remove());
    error.textContent = "";
    const body = {values, engine: engine.value, connection: connection.value, num_clients: clients.value};
    try {
      const r = await api(go ? "/api/launch" : "/api/validate", body);
      if (go) location.hash = "#/run/" + encodeURIComponent(r.id);
      else command.textContent = r.argv.join(" ");
    } catch (e) {
      error.textContent = e.message;
      const node = e.key && (inputs[e.key] || document.getElementById("field-" + e.key));
      if (node) {  // the message next to the field too, where the eye is
        node.classList.add("invalid");
        node.closest(".field").append(el("p", {class: "error field-error"}, e.message));
        node.closest("details")?.setAttribute("open", "");
        node.focus();
      }
    }
  }
}

// ------------------------------------------------------------------ router
function route() {
  const {path, params} = parseHash();
  document.querySelectorAll("nav a").forEach((a) => a.classList.remove("active"));
  if (path.startsWith("/run/")) showRun(decodeURIComponent(path.slice(5)));
  else if (path.startsWith("/study/")) showStudy(decodeURIComponent(path.slice(7)));
  else if (path === "/launch-study") { showLaunchStudy(); document.getElementById("nav-launch").classList.add("active"); }
  else if (path === "/compare") { showCompare(params); document.getElementById("nav-compare").classList.add("active"); }
  else if (path === "/launch") { showLaunch(params); document.getElementById("nav-launch").classList.add("active"); }
  else { showRuns(); document.getElementById("nav-runs").classList.add("active"); }
}
window.addEventListener("hashchange", route);
Promise.all([fetch("/api/runs").then((r) => r.json()), fetch("/api/studies").then((r) => r.json())])
  .then(([r, s]) => { runs = r.runs; studies = s.studies; route(); connect(); });
