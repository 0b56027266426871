// The /dashboard page: draws the snapshots of /dashboard/events (paged_jax/engine/pool_snapshot.py).
// Plain browser JavaScript, no library: the server ships this file inside the package and the
// machine it runs on may have no internet.
"use strict";
(function () {
  const COLORS = {free: "#e9ecef", used: "#4c78a8", shared: "#f58518", cached: "#a6dba0", null: "#333333",
                  reserved: "#f2cf5b", fragment: "#f4a6a6"};
  const LABELS = {free: "free", used: "used", shared: "shared (ref count > 1)", cached: "free, still cached (LRU)",
                  null: "null block", reserved: "reserved, not yet written",
                  fragment: "free, in a gap too short for the next request"};
  const OUTLINE = "#d62728";
  const HISTORY = 240;  // points per time series
  const key = new URLSearchParams(window.location.search).get("key");
  const query = key ? "?key=" + encodeURIComponent(key) : "";
  const $ = (id) => document.getElementById(id);

  let states = [];  // code digit -> state name
  let latest = null;  // the newest snapshot
  let previous = null;  // the one before (rates)
  let selected = null;  // request id whose blocks are outlined (hover or click)
  let pinned = false;  // a click keeps the selection when the pointer leaves
  let received = 0;

  // ---- time series -------------------------------------------------------------------------------
  const CHARTS = [
    {id: "util", title: "KV utilization (tokens / slots) and blocks held", unit: "%",
     lines: [["tokens", "#4c78a8", (s) => 100 * s.counters.kv_utilization],
             ["blocks", "#9ecae9", (s) => 100 * s.counters.num_blocks_used / Math.max(1, s.counters.num_blocks_total)]]},
    {id: "waste", title: "waste, token slots", unit: "",
     lines: [["internal", "#e45756", (s) => s.counters.waste_internal_slots],
             ["reservation", "#f2cf5b", (s) => s.counters.waste_reservation_slots],
             ["external", "#b279a2", (s) => s.counters.waste_external_slots]]},
    {id: "batch", title: "sequences", unit: "",
     lines: [["running", "#4c78a8", (s) => s.counters.num_running],
             ["waiting", "#f58518", (s) => s.counters.num_waiting],
             ["swapped", "#54a24b", (s) => s.counters.num_swapped]]},
    {id: "preempt", title: "preemptions per second", unit: "/s",
     lines: [["preempted", "#e45756", (s, p, dt) => p ? (s.counters.num_preemptions - p.counters.num_preemptions) / dt : 0]]},
    {id: "hits", title: "prefix-cache hit rate (since the last point)", unit: "%",
     lines: [["hit", "#54a24b", (s, p) => {
       if (!p) return null;
       const q = s.counters.prefix_cache_query_tokens - p.counters.prefix_cache_query_tokens;
       return q > 0 ? 100 * (s.counters.prefix_cache_hit_tokens - p.counters.prefix_cache_hit_tokens) / q : null;
     }]]},
    {id: "tokens", title: "generated tokens per second", unit: "/s",
     lines: [["tokens", "#4c78a8", (s, p, dt) => p ? (s.counters.num_generated_tokens - p.counters.num_generated_tokens) / dt : 0]]},
  ];
  const series = {};

  function buildCharts() {
    const box = $("charts");
    for (const chart of CHARTS) {
      const div = document.createElement("div");
      div.className = "chart";
      const h = document.createElement("h3");
      h.textContent = chart.title;
      const now = document.createElement("span");
      now.className = "now";
      now.id = "now-" + chart.id;
      h.appendChild(now);
      const canvas = document.createElement("canvas");
      canvas.id = "chart-" + chart.id;
      canvas.width = 300;
      canvas.height = 110;
      div.appendChild(h);
      div.appendChild(canvas);
      box.appendChild(div);
      series[chart.id] = chart.lines.map(() => []);
    }
  }

  function pushSeries(snap, prev) {
    const dt = prev ? Math.max(1e-3, snap.time - prev.time) : 1;
    for (const chart of CHARTS) {
      chart.lines.forEach(([, , value], i) => {
        const points = series[chart.id][i];
        points.push(value(snap, prev, dt));
        if (points.length > HISTORY) points.shift();
      });
    }
  }

  function drawChart(chart) {
    const canvas = $("chart-" + chart.id);
    const ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height, pad = 4;
    ctx.clearRect(0, 0, w, h);
    const all = series[chart.id].flat().filter((v) => v !== null && Number.isFinite(v));
    const top = Math.max(1e-9, ...all, chart.unit === "%" ? 100 : 1);
    ctx.strokeStyle = "#eee";
    ctx.beginPath();
    ctx.moveTo(0, h - pad);
    ctx.lineTo(w, h - pad);
    ctx.stroke();
    const now = [];
    chart.lines.forEach(([name, color], i) => {
      const points = series[chart.id][i];
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let drawing = false;
      points.forEach((v, j) => {
        if (v === null || !Number.isFinite(v)) { drawing = false; return; }
        const x = (j / Math.max(1, points.length - 1)) * w;
        const y = h - pad - (v / top) * (h - 2 * pad);
        if (drawing) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        drawing = true;
      });
      ctx.stroke();
      const last = points[points.length - 1];
      if (last !== null && last !== undefined && Number.isFinite(last)) {
        now.push(name + " " + (Math.abs(last) >= 100 ? last.toFixed(0) : last.toFixed(1)) + chart.unit);
      }
    });
    $("now-" + chart.id).textContent = now.join(" · ");
  }

  // ---- the block grid ----------------------------------------------------------------------------
  function layout(canvas, n, maxHeight) {
    const width = canvas.clientWidth || canvas.width;
    let cell = Math.floor(Math.sqrt((width * maxHeight) / Math.max(1, n)));
    cell = Math.max(3, Math.min(cell, 28));
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.ceil(n / cols);
    if (canvas.width !== width) canvas.width = width;
    if (canvas.height !== rows * cell) canvas.height = Math.max(cell, rows * cell);
    return {cell, cols};
  }

  function drawPool(canvas, codes, outlined, colorOf, maxHeight) {
    const n = codes.length;
    const {cell, cols} = layout(canvas, n, maxHeight);
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const gap = cell >= 6 ? 1 : 0;
    for (let i = 0; i < n; i++) {
      ctx.fillStyle = colorOf(codes.charCodeAt(i) - 48);
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
    }
    ctx.strokeStyle = OUTLINE;
    ctx.lineWidth = Math.max(1, Math.floor(cell / 5));
    for (const i of outlined) {
      if (i >= 0 && i < n) {
        const inset = ctx.lineWidth / 2;
        ctx.strokeRect((i % cols) * cell + inset, Math.floor(i / cols) * cell + inset,
                       cell - gap - 2 * inset, cell - gap - 2 * inset);
      }
    }
  }

  function selectedBlocks(onHost) {
    const request = latest && latest.requests.find((r) => r.request_id === selected);
    if (!request) return [];
    return request.seqs.filter((s) => s.on_host === onHost).flatMap((s) => s.blocks);
  }

  function drawGrids() {
    if (!latest) return;
    drawPool($("pool"), latest.blocks, selectedBlocks(false), (code) => COLORS[states[code]] || "#000", 420);
    const host = latest.host_blocks;
    $("host-section").hidden = host.length === 0;
    if (host.length) {
      drawPool($("host"), host, selectedBlocks(true), (code) => COLORS[states[code]] || COLORS.used, 120);
      $("host-caption").textContent = (host.length - countOf(host, 0)) + " of " + host.length + " used";
    }
  }

  function countOf(codes, code) {
    let n = 0;
    for (let i = 0; i < codes.length; i++) if (codes.charCodeAt(i) - 48 === code) n++;
    return n;
  }

  // ---- requests ----------------------------------------------------------------------------------
  function cell(row, text) {
    const td = document.createElement("td");
    td.textContent = text;
    row.appendChild(td);
  }

  function drawRequests() {
    const body = $("requests");
    body.replaceChildren();
    for (const r of latest.requests) {
      const row = document.createElement("tr");
      row.dataset.request = r.request_id;
      if (r.request_id === selected) row.className = "highlighted";
      const blocks = new Set(r.seqs.flatMap((s) => (s.on_host ? [] : s.blocks)));
      const id = r.request_id.length > 24 ? r.request_id.slice(0, 12) + "…" + r.request_id.slice(-6) : r.request_id;
      cell(row, id);
      row.title = r.request_id;
      cell(row, r.state);
      cell(row, String(r.seqs.length));
      cell(row, r.seqs.map((s) => s.num_tokens).join(", "));
      cell(row, String(blocks.size) + (r.seqs.some((s) => s.on_host) ? " (on host)" : ""));
      row.addEventListener("mouseenter", () => { if (!pinned) select(r.request_id); });
      row.addEventListener("mouseleave", () => { if (!pinned) select(null); });
      row.addEventListener("click", () => {
        pinned = !(pinned && selected === r.request_id);
        select(pinned ? r.request_id : null);
      });
      body.appendChild(row);
    }
  }

  function select(requestId) {
    selected = requestId;
    for (const row of $("requests").children) {
      row.className = row.dataset.request === selected ? "highlighted" : "";
    }
    drawGrids();
  }

  // ---- one snapshot ------------------------------------------------------------------------------
  function show(snap) {
    previous = latest;
    latest = snap;
    received += 1;
    if (!states.length) {
      states = snap.states;
      const contiguousOnly = new Set(["reserved", "fragment"]);  // states only a contiguous baseline has
      const shown = states.filter((name) => snap.allocator !== "paged" || !contiguousOnly.has(name));
      $("legend").replaceChildren(...shown.map((name) => {
        const span = document.createElement("span");
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = COLORS[name];
        span.appendChild(swatch);
        span.appendChild(document.createTextNode(LABELS[name] || name));
        return span;
      }));
    }
    const c = snap.counters;
    $("n-used").textContent = c.num_blocks_used;
    $("n-free").textContent = c.num_blocks_free;
    $("n-shared").textContent = c.num_blocks_shared;
    $("n-cached").textContent = c.num_blocks_cached;
    $("n-running").textContent = c.num_running;
    $("n-waiting").textContent = c.num_waiting;
    $("n-swapped").textContent = c.num_swapped;
    $("kv-util").textContent = (100 * c.kv_utilization).toFixed(1) + "%";
    $("allocator").textContent = snap.allocator + ", blocks of " + snap.block_size + " tokens";
    $("step").textContent = "step " + c.num_steps;
    $("pool-caption").textContent = c.num_blocks_total + " usable";
    if (selected && !snap.requests.some((r) => r.request_id === selected)) {
      selected = null;
      pinned = false;
    }
    pushSeries(snap, previous);
    drawRequests();
    drawGrids();
    CHARTS.forEach(drawChart);
    document.body.dataset.snapshots = String(received);  // for scripts and tests: how many arrived
    document.body.dataset.step = String(c.num_steps);
  }

  function connect() {
    const source = new EventSource("/dashboard/events" + query);
    source.onopen = () => { $("status").textContent = "live"; $("status").className = ""; };
    source.onmessage = (event) => show(JSON.parse(event.data));
    source.onerror = () => { $("status").textContent = "reconnecting…"; $("status").className = "down"; };
  }

  buildCharts();
  window.addEventListener("resize", drawGrids);
  connect();
})();
