// gpu-exporter's status page: redraws the tables from /snapshot (and /peers, /history) every
// interval. The server renders the same tables (exporter/web/page.py) for readers without
// JavaScript; keep the two in step (tests/test_page*.py compare them with /snapshot).
// Every string from a process or a peer goes in with textContent: nothing here parses HTML.
"use strict";

(function () {
  const body = document.body;
  const interval = Math.max(0.5, parseFloat(body.dataset.interval) || 2);
  const historySeconds = parseFloat(body.dataset.history) || 300;
  const hasPeers = body.dataset.peers === "1";
  const LEVELS = ["ok", "warning", "critical"];
  const SVG = "http://www.w3.org/2000/svg";
  let lastTimestamp = null;

  // -- formatting: the same rules as page.py's (half-up rounding in both) --------------------

  function round(x, digits) {
    const f = Math.pow(10, digits);
    return Math.floor(x * f + 0.5) / f;
  }
  function pct(x) {
    return x === null || x === undefined ? "-" : round(x * 100, 0).toFixed(0) + " %";
  }
  function bytes(x) {
    if (x === null || x === undefined) return "-";
    const units = ["B", "KiB", "MiB", "GiB"];
    for (const unit of units) {
      if (Math.abs(x) < 1024) return unit === "B" ? x.toFixed(0) + " B" : round(x, 1).toFixed(1) + " " + unit;
      x /= 1024;
    }
    return round(x, 1).toFixed(1) + " TiB";
  }
  function number(x, unit) {
    return x === null || x === undefined ? "-" : round(x, 0).toFixed(0) + unit;
  }
  function clock(t) {
    return new Date(t * 1000).toISOString().slice(11, 19) + " UTC";
  }

  // -- DOM helpers ---------------------------------------------------------------------------

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }
  function cell(row, field, parts, cls) {
    const td = el("td", null, cls);
    td.dataset.field = field;
    for (const part of parts) td.append(typeof part === "string" ? document.createTextNode(part) : part);
    row.append(td);
    return td;
  }
  function level(name) {
    return el("span", name, "level level-" + name);
  }
  function replaceRows(id, rows, empty, columns) {
    const tbody = document.querySelector("#" + id + " tbody");
    if (!tbody) return;
    if (!rows.length) {
      const tr = el("tr");
      const td = el("td", empty, "empty");
      td.colSpan = columns;
      tr.append(td);
      rows = [tr];
    }
    tbody.replaceChildren(...rows);
  }

  // -- the GPU table -------------------------------------------------------------------------

  function gpuRow(gpu) {
    const info = gpu.info || {};
    const tr = el("tr");
    tr.dataset.uuid = gpu.uuid;
    const th = el("th", String(gpu.index));
    th.scope = "row";
    th.append(" ", el("span", info.name || "unknown", "name"));
    tr.append(th);
    if (!gpu.up) {
      const td = cell(tr, "error", ["down: " + (gpu.error || "not answering")], "down");
      td.colSpan = 8;
      return tr;
    }
    const sm = (gpu.fields || {}).sm_active;
    const util = [pct(gpu.utilization_ratio)];
    if (sm !== undefined && sm !== null) util.push(el("small", "SM " + pct(sm)));
    cell(tr, "utilization", util);
    const total = info.memory_total_bytes;
    const meter = el("meter");
    if (total && gpu.memory_used_bytes !== null) {
      meter.min = 0;
      meter.max = total;
      meter.high = total * 0.9;
      meter.value = gpu.memory_used_bytes;
    }
    cell(tr, "memory", [meter, bytes(gpu.memory_used_bytes) + " / " + bytes(total)]);
    const thermal = gpu.thermal ? LEVELS[gpu.thermal.level] : null;
    const temp = [number(gpu.temperature_celsius, " °C")];
    if (thermal) temp.push(" ", level(thermal));
    cell(tr, "temperature", temp);
    cell(tr, "power", [number(gpu.power_watts, "") + " / " + number(info.power_limit_watts, " W")]);
    const events = gpu.clock_events_active;
    const active = events ? Object.keys(events).filter((k) => events[k] && k !== "gpu_idle") : null;
    cell(tr, "clock_events", [active === null ? "-" : active.join(", ") || "none"]);
    const health = gpu.health;
    const parts = [health ? level(health.verdict) : "-"];
    if (health && health.reasons.length) parts.push(el("small", health.reasons.join("; ")));
    const xids = (gpu.xids || []).slice(-3);
    if (xids.length) {
      parts.push(el("small", "XID " + xids.map((x) => x.xid + " at " + clock(x.timestamp)).join(", ")));
    }
    cell(tr, "health", parts);
    let lock = "free";
    if (gpu.reserved_by !== null && gpu.reserved_by !== undefined) {
      lock = gpu.reserved_by ? "PID " + gpu.reserved_by : "another PID namespace";
      if (gpu.reserved_by_user) lock += " (" + gpu.reserved_by_user + ")";
    }
    cell(tr, "lock", [lock]);
    const chosen = gpu.recommended === null || gpu.recommended === undefined ? "-" : gpu.recommended ? "yes" : "no";
    cell(tr, "recommended", [chosen]);
    return tr;
  }

  // -- the process table ---------------------------------------------------------------------

  function owner(proc) {
    if (proc.pod) return "pod " + proc.namespace + "/" + proc.pod;
    if (proc.slurm_job) return "Slurm job " + proc.slurm_job;
    return "-";
  }
  function flags(proc) {
    const out = [];
    const cls = proc.reaper && proc.reaper.class;
    if (cls) out.push("zombie: " + cls);
    const waste = proc.waste;
    if (waste && waste.idle_holder) out.push("idle holder");
    if (waste && waste.leak_growth_bytes !== null && waste.leak_growth_bytes !== undefined) out.push("leak suspect");
    if (proc.outside_allocation) out.push("outside its allocation");
    return out.join(", ") || "-";
  }
  function processRows(doc) {
    const rows = [];
    for (const gpu of doc.gpus) {
      for (const proc of gpu.processes || []) {
        // no field names on these cells: the column headers have them (page.py's PROCESS_FIELDS)
        const tr = el("tr");
        tr.dataset.gpu = String(gpu.index);
        tr.dataset.pid = String(proc.pid);
        const th = el("th", String(proc.pid));
        th.scope = "row";
        const name = el("td", proc.name || "-");
        if (proc.cmdline && proc.cmdline.length) name.append(el("small", proc.cmdline.join(" "), "cmdline"));
        tr.append(el("td", String(gpu.index)), th, el("td", proc.user || "-"), name);
        tr.append(el("td", bytes(proc.used_memory_bytes)), el("td", owner(proc)), el("td", flags(proc)));
        rows.push(tr);
      }
    }
    return rows;
  }

  // -- the header, the reaper, the hosts -----------------------------------------------------

  function header(doc) {
    const agent = document.getElementById("agent-health");
    if (agent) {
      const ok = doc.health && doc.health.ok;
      agent.replaceChildren(level(ok ? "ok" : "critical"), " " + (ok ? "healthy" : doc.health ? doc.health.reason : "unknown"));
    }
    lastTimestamp = doc.timestamp;
    tick();
  }
  function tick() {
    const age = document.getElementById("age");
    if (age && lastTimestamp !== null) age.textContent = Math.max(0, Date.now() / 1000 - lastTimestamp).toFixed(1) + " s";
  }
  function reaper(doc) {
    const mode = document.getElementById("reaper-mode");
    if (!mode) return;
    const r = doc.reaper;
    mode.textContent = !r ? "off" : r.dry_run ? "dry run (reports, never signals)" : "kill (signals confirmed orphans)";
    const rows = ((r && r.recent) || []).slice().reverse().map((d) => {
      const tr = el("tr");
      const th = el("th", clock(d.time));
      th.scope = "row";
      tr.append(th);
      cell(tr, "gpu", [d.gpu === null ? "-" : String(d.gpu)]);
      cell(tr, "pid", [d.pid === null ? "-" : String(d.pid)]);
      cell(tr, "process", [d.process || "-"]);
      cell(tr, "class", [d.class || "-"]);
      cell(tr, "decision", [[d.event, d.signal, d.reason].filter((w) => w).join(" ")]);
      return tr;
    });
    replaceRows("decisions", rows, "No decisions yet.", 6);
  }
  function peerRows(peers) {
    return peers.map((p) => {
      const tr = el("tr");
      tr.dataset.url = p.url;
      const th = el("th");
      th.scope = "row";
      const a = el("a", p.hostname || p.url);
      a.href = p.url;
      th.append(a);
      tr.append(th);
      if (!p.up) {
        cell(tr, "state", [level("down"), " " + p.error], "down").colSpan = 5;
        return tr;
      }
      cell(tr, "state", [level("up")]);
      cell(tr, "free", [p.gpus_free + " / " + p.gpus]);
      cell(tr, "busiest", [p.busiest ? pct(p.busiest.utilization_ratio) + " (GPU " + p.busiest.gpu + ")" : "-"]);
      cell(tr, "hottest", [p.hottest ? number(p.hottest.temperature_celsius, " °C") + " (GPU " + p.hottest.gpu + ")" : "-"]);
      cell(tr, "health", [p.health ? level(p.health) : "-"]);
      return tr;
    });
  }

  // -- charts from /history ------------------------------------------------------------------

  function spark(values, max, label) {
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", "0 0 100 20");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("role", "img");
    const known = values.filter((v) => v !== null);
    const last = known.length ? known[known.length - 1] : null;
    svg.setAttribute("aria-label", label);
    const line = document.createElementNS(SVG, "polyline");
    const n = values.length;
    const points = [];
    values.forEach((v, i) => {
      if (v !== null) points.push(((n > 1 ? i / (n - 1) : 1) * 100).toFixed(1) + "," + (20 - Math.min(1, v / max) * 20).toFixed(1));
    });
    line.setAttribute("points", points.join(" "));
    svg.append(line);
    return [svg, last];
  }
  function charts(history) {
    const box = document.getElementById("charts");
    if (!box) return;
    const figures = history.gpus.map((g) => {
      const fig = el("figure");
      fig.dataset.uuid = g.uuid;
      fig.append(el("figcaption", "GPU " + g.index + " " + (g.name || "")));
      const series = [
        ["utilization", g.utilization_ratio, 1, pct],
        ["memory", g.memory_used_bytes, g.memory_total_bytes || 1, bytes],
        ["temperature", g.temperature_celsius, 100, (v) => number(v, " °C")],
      ];
      for (const [name, values, max, fmt] of series) {
        const [svg, last] = spark(values || [], max, name + " over the last " + Math.round(history.seconds) + " s");
        const row = el("div", null, "spark");
        row.dataset.series = name;
        row.append(el("span", name, "spark-name"), svg, el("span", last === null ? "-" : fmt(last), "spark-last"));
        fig.append(row);
      }
      return fig;
    });
    box.replaceChildren(...figures);
    box.hidden = false;
  }

  // -- the loop ------------------------------------------------------------------------------

  async function json(path) {
    const response = await fetch(path, { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) throw new Error(path + ": HTTP " + response.status);
    return response.json();
  }
  function problem(text) {
    const box = document.getElementById("problem");
    if (!box) return;
    box.textContent = text || "";
    box.hidden = !text;
  }
  async function refresh() {
    try {
      const doc = await json("snapshot");
      header(doc);
      replaceRows("gpus", doc.gpus.map(gpuRow), "No GPUs.", 9);
      replaceRows("processes", processRows(doc), "No GPU processes.", 7);
      reaper(doc);
      if (hasPeers) replaceRows("hosts", peerRows(await json("peers")), "No peers.", 6);
      charts(await json("history?seconds=" + historySeconds));
      problem("");
      body.dataset.js = "1";
      body.dataset.updated = String(doc.seq);
    } catch (err) {
      problem("Could not refresh: " + err.message + " (retrying)");
    }
    setTimeout(refresh, interval * 1000);
  }
  setInterval(tick, 1000);
  refresh();
})();
