// pagedserve's dashboard: polls /dashboard/api/state and draws every worker's KV blocks and the cluster's series.
// Plain JS and canvas; nothing is fetched from anywhere but this gateway.
"use strict";
(() => {
  const KEY_STORE = "pagedserve-api-key";  // sessionStorage: this tab only, gone when it closes
  const POLL_MS = 500;
  const SPAN_S = 300;  // the charts' time window
  const MAP_MAX_HEIGHT = 320;  // px: a large cache gets smaller cells rather than a taller map
  const COLORS = { null: "#3f4654", free: "#e3e6ea", cached: "#93c5fd", used: "#1d4ed8", shared: "#f59e0b",
                   moving: "#dc2626" };
  const LABELS = { free: "free", cached: "free, cached", used: "used by one", shared: "shared", moving: "copying / swapping" };
  const LINE = ["#1d4ed8", "#dc2626", "#059669", "#9333ea"];
  const $ = (id) => document.getElementById(id);
  const views = new Map();  // worker id → its section's elements and latest data
  let paused = false;
  let hover = null;  // {view, block, x, y}

  function bytes(b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  function setStatus(text, bad) {
    $("status").textContent = text;
    $("status").classList.toggle("bad", !!bad);
  }

  // ---- polling and the API key --------------------------------------------------------------------------
  async function poll() {
    const key = sessionStorage.getItem(KEY_STORE);
    let resp;
    try {
      resp = await fetch("/dashboard/api/state", { headers: key ? { Authorization: "Bearer " + key } : {},
                                                   cache: "no-store" });
    } catch (e) {
      setStatus("the gateway does not answer: " + e.message, true);
      return setTimeout(poll, 2000);
    }
    if (resp.status === 401) {
      sessionStorage.removeItem(KEY_STORE);
      return askKey(key ? "the gateway refused that key" : "");
    }
    if (!resp.ok) {
      const body = await resp.json().catch(() => null);
      setStatus(`the gateway answered ${resp.status}: ${body && body.error ? body.error.message : resp.statusText}`, true);
      return setTimeout(poll, 2000);
    }
    const state = await resp.json();
    $("forget-key").hidden = !key;
    if (!paused) render(state);
    setTimeout(poll, POLL_MS);
  }

  function askKey(error) {
    $("key-form").hidden = false;
    $("cluster").hidden = true;
    $("workers").hidden = true;
    $("key-error").textContent = error;
    setStatus("waiting for the API key");
    $("key-input").focus();
  }

  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("key-input").value);
    $("key-input").value = "";
    $("key-form").hidden = true;
    $("workers").hidden = false;
    poll();
  });
  $("forget-key").addEventListener("click", () => { sessionStorage.removeItem(KEY_STORE); location.reload(); });
  $("pause").addEventListener("click", () => {
    paused = !paused;
    $("pause").setAttribute("aria-pressed", String(paused));
    $("pause").textContent = paused ? "resume" : "pause";
  });

  // ---- rendering ----------------------------------------------------------------------------------------
  function render(state) {
    const snap = state.snapshot;
    document.documentElement.dataset.updated = String(state.time);
    $("cluster").hidden = false;
    if (!snap) {
      setStatus(`no cache snapshot yet (the scheduler publishes one while this page polls) · ` +
                `${state.workers_alive.length} workers with a heartbeat`);
      renderCluster(state, null);
      return;
    }
    document.documentElement.dataset.snapshotTime = String(snap.time);
    const age = Math.max(0, state.time - snap.time);
    setStatus(`snapshot ${age.toFixed(1)} s old · ${snap.workers.length} workers in the scheduler, ` +
              `${state.workers_alive.length} with a heartbeat · ${snap.unplaced} requests wait for a worker` +
              (paused ? " · paused" : ""), age > 5);
    const seen = new Set();
    for (const w of [...snap.workers].sort((a, b) => a.worker_id.localeCompare(b.worker_id))) {
      seen.add(w.worker_id);
      const v = view(w.worker_id);
      $("workers").appendChild(v.section);  // (moves it) workers in the order of their ids
      renderWorker(v, w, snap, state);
    }
    for (const [id, v] of views) {
      if (!seen.has(id)) { v.section.remove(); views.delete(id); }
    }
    renderCluster(state, snap);
    if (hover) showTooltip(hover.view, hover.block, hover.x, hover.y);
  }

  function renderCluster(state, snap) {
    const g = state.gateway;
    const last = (xs) => (xs.length ? xs[xs.length - 1] : null);
    const tokens = snap ? clusterTokens(snap) : { time: [], values: [] };
    $("cluster-stats").innerHTML = [
      ["requests/s", fmt(last(g.requests_per_s))], ["output tokens/s", fmt(last(tokens.values))],
      ["TTFT p50 / p99", `${fmt(last(g.ttft_p50), 3)} / ${fmt(last(g.ttft_p99), 3)} s`],
      ["TPOT p50 / p99", `${fmt(last(g.tpot_p50), 3)} / ${fmt(last(g.tpot_p99), 3)} s`],
      ["workers alive", `<span data-count="workers-alive">${state.workers_alive.length}</span>`],
    ].map(([k, v]) => `${k} <b>${v}</b>`).join(" · ");
    renderTenants(snap ? snap.tenants : []);
    const now = state.time;
    chart($("chart-requests"), now, [{ label: "requests/s", time: g.time, values: g.requests_per_s }]);
    chart($("chart-tokens"), now, [{ label: "tokens/s", time: tokens.time, values: tokens.values }]);
    chart($("chart-ttft"), now, [{ label: "p50", time: g.time, values: g.ttft_p50 },
                                 { label: "p99", time: g.time, values: g.ttft_p99 }]);
    chart($("chart-tpot"), now, [{ label: "p50", time: g.time, values: g.tpot_p50 },
                                 { label: "p99", time: g.time, values: g.tpot_p99 }]);
    chart($("chart-workers"), now, [{ label: "workers", time: snap ? snap.history_time : [],
                                      values: snap ? snap.history_workers : [] }]);
  }

  function renderTenants(tenants) {
    // Each tenant's share of the tokens computed in the last minute, with its running and waiting work.
    const total = tenants.reduce((sum, t) => sum + t.tokens_last_minute, 0);
    const el = $("tenant-shares");
    el.hidden = tenants.length < 2;
    el.innerHTML = tenants.map((t) => {
      const share = total ? `${Math.round((100 * t.tokens_last_minute) / total)} %` : "–";
      return `<span data-tenant="${escape(t.tenant)}">${escape(t.tenant)} <b data-share>${share}</b> ` +
        `<small>${t.running_seqs} running · ${t.waiting} waiting</small></span>`;
    }).join(" · ");
  }

  function clusterTokens(snap) {
    // Each worker's columns end at the snapshot's last sample; a worker that joined later has fewer.
    const n = snap.history_time.length;
    const values = new Array(n).fill(0);
    for (const w of snap.workers) {
      const col = w.history.sampled;
      for (let i = 0; i < col.length; i++) values[n - col.length + i] += col[i] / snap.interval;
    }
    return { time: snap.history_time, values };
  }

  function view(id) {
    let v = views.get(id);
    if (v) return v;
    const section = document.createElement("section");
    section.className = "worker";
    section.dataset.worker = id;
    const legend = Object.keys(LABELS).map((s) =>
      `<span><i data-state="${s}"></i>${LABELS[s]} <b data-count="${s}">0</b></span>`).join("");
    section.innerHTML = `<h2></h2>
      <div class="legend">${legend}<span>in use <b data-count="in-use">0</b> of <b data-count="blocks">0</b>
        (<b data-count="usage">0</b>)</span></div>
      <div class="queues"></div>
      <canvas class="blockmap"></canvas>
      <div class="charts">
        <figure><figcaption>batch <small>sequences and tokens per step</small></figcaption><canvas class="chart" data-chart="batch"></canvas></figure>
        <figure><figcaption>requests <small>running, waiting, preempted</small></figcaption><canvas class="chart" data-chart="queues"></canvas></figure>
        <figure><figcaption>prefix-cache hit rate <small>share of prompt tokens looked up</small></figcaption><canvas class="chart" data-chart="hits"></canvas></figure>
      </div>`;
    for (const i of section.querySelectorAll(".legend i")) i.style.background = COLORS[i.dataset.state];  // (CSP: no inline styles)
    $("workers").appendChild(section);
    v = { section, map: section.querySelector("canvas.blockmap"), data: null, holders: null, layout: null };
    v.map.addEventListener("mousemove", (e) => {
      const block = blockAt(v, e.offsetX, e.offsetY);
      hover = block === null ? null : { view: v, block, x: e.clientX, y: e.clientY };
      if (hover) showTooltip(v, block, e.clientX, e.clientY); else $("tooltip").hidden = true;
    });
    v.map.addEventListener("mouseleave", () => { hover = null; $("tooltip").hidden = true; });
    views.set(id, v);
    return v;
  }

  function renderWorker(v, w, snap, state) {
    const names = state.states;
    const states = bytes(w.states);
    const refs = bytes(w.ref_counts);
    const counts = Object.fromEntries(names.concat(["moving"]).map((s) => [s, 0]));
    for (let i = 0; i < states.length; i++) {
      counts[names[states[i] & ~state.moving]]++;
      if (states[i] & state.moving) counts.moving++;
    }
    const usable = states.length - counts.null;
    const inUse = counts.used + counts.shared;
    v.data = { w, states, refs, names, movingBit: state.moving };
    v.holders = null;  // built on the first hover over this snapshot
    v.section.dataset.snapshotTime = String(snap.time);
    v.section.querySelector("h2").innerHTML =
      `${escape(w.worker_id)} <small>${usable} blocks of ${w.block_size} tokens · swap ${w.swap_blocks - w.swap_free} of ${w.swap_blocks} blocks used</small>`;
    for (const s of Object.keys(LABELS)) {
      v.section.querySelector(`[data-count="${s}"]`).textContent = String(counts[s]);
    }
    v.section.querySelector('[data-count="in-use"]').textContent = String(inUse);
    v.section.querySelector('[data-count="blocks"]').textContent = String(usable);
    v.section.querySelector('[data-count="usage"]').textContent = usable ? (100 * inUse / usable).toFixed(1) + "%" : "–";
    const rate = w.prefix_queries ? (100 * w.prefix_hits / w.prefix_queries).toFixed(1) + "%" : "–";
    v.section.querySelector(".queues").innerHTML =
      `running <b data-count="running">${w.running}</b> requests (<b>${w.running_seqs}</b> sequences) · ` +
      `waiting <b data-count="waiting">${w.waiting}</b> · preempted <b data-count="preempted">${w.preempted}</b>` +
      ` (swapped ${w.swapped}) · prefix-cache hit rate <b data-count="hit-rate">${rate}</b> since it joined` +
      (w.drafts ? ` · speculation: <b data-count="acceptance">${(100 * w.accepted_tokens / w.draft_tokens).toFixed(1)}%` +
        `</b> of draft tokens accepted, <b data-count="acceptance-length">${(1 + w.accepted_tokens / w.drafts).toFixed(2)}` +
        `</b> tokens per drafting step` : "");
    drawMap(v);
    const h = w.history;
    const t = snap.history_time.slice(snap.history_time.length - h.steps.length);
    const per = (col) => col.map((x, i) => (h.steps[i] ? x / h.steps[i] : null));
    const c = (name) => v.section.querySelector(`[data-chart="${name}"]`);
    chart(c("batch"), state.time, [{ label: "seqs/step", time: t, values: per(h.seqs) },
                                   { label: "tokens/step", time: t, values: per(h.tokens) }]);
    chart(c("queues"), state.time, [{ label: "running", time: t, values: h.running },
                                    { label: "waiting", time: t, values: h.waiting },
                                    { label: "preempted", time: t, values: h.preempted }]);
    chart(c("hits"), state.time, [{ label: "hit %", time: t, values:
      h.prefix_queries.map((q, i) => (q ? 100 * h.prefix_hits[i] / q : null)) }], 100);
  }

  // ---- the block map ------------------------------------------------------------------------------------
  function drawMap(v) {
    const { states, names, movingBit } = v.data;
    const n = states.length;
    const width = Math.max(100, v.map.clientWidth);
    const cell = Math.max(1, Math.min(14, Math.floor(Math.sqrt(width * MAP_MAX_HEIGHT / n))));
    const cols = Math.floor(width / cell);
    const rows = Math.ceil(n / cols);
    v.layout = { cell, cols };
    v.map.dataset.cell = String(cell);  // where block i is drawn: (i % cols, i / cols) cells from the top left
    v.map.dataset.cols = String(cols);
    if (v.map.width !== width || v.map.height !== rows * cell) {
      v.map.width = width;
      v.map.height = rows * cell;
    }
    const ctx = v.map.getContext("2d");
    const img = ctx.createImageData(width, rows * cell);
    const rgb = names.map((s) => hex(COLORS[s]));
    const moving = hex(COLORS.moving);
    const fill = cell >= 5 ? cell - 1 : cell;  // a gap between larger cells
    const px = img.data;
    for (let i = 0; i < n; i++) {
      const s = states[i];
      const [r, g, b] = s & movingBit ? moving : rgb[s];
      const x0 = (i % cols) * cell, y0 = Math.floor(i / cols) * cell;
      for (let y = y0; y < y0 + fill; y++) {
        let o = (y * width + x0) * 4;
        for (let x = 0; x < fill; x++, o += 4) { px[o] = r; px[o + 1] = g; px[o + 2] = b; px[o + 3] = 255; }
      }
    }
    ctx.putImageData(img, 0, 0);
  }

  function blockAt(v, x, y) {
    if (!v.layout || !v.data) return null;
    const { cell, cols } = v.layout;
    const col = Math.floor(x / cell);
    const i = Math.floor(y / cell) * cols + col;
    return col < cols && i >= 0 && i < v.data.states.length ? i : null;
  }

  function holdersOf(v, block) {
    if (!v.holders) {
      const w = v.data.w;
      const raw = bytes(w.holder_blocks);
      const ids = new DataView(raw.buffer);
      v.holders = new Map();
      let k = 0;
      w.holder_counts.forEach((count, r) => {
        for (let j = 0; j < count; j++, k++) {
          const b = ids.getUint32(4 * k, true);
          if (!v.holders.has(b)) v.holders.set(b, []);
          v.holders.get(b).push(w.holder_rids[r]);
        }
      });
    }
    return v.holders.get(block) || [];
  }

  function showTooltip(v, block, x, y) {
    if (!v.data || block >= v.data.states.length) return;
    const { states, refs, names, movingBit, w } = v.data;
    const s = states[block];
    const name = names[s & ~movingBit];
    const lines = [`block ${block}: ${LABELS[name] || name}${s & movingBit ? ", " + LABELS.moving : ""}`,
                   `ref count ${refs[block] === 255 ? "255 or more" : refs[block]}`];
    if (name === "used" || name === "shared") {
      const rids = holdersOf(v, block);
      if (rids.length) {
        lines.push(`held by ${rids.length === 1 ? "" : rids.length + " requests: "}` + rids.slice(0, 8).join(", ") +
                   (rids.length > 8 ? `, and ${rids.length - 8} more` : ""));
      } else if (!w.holders_complete) {
        lines.push("its requests are past the snapshot's bound on listed holders");
      }
    }
    const tip = $("tooltip");
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    tip.style.left = Math.min(x + 14, window.innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = (y + 14) + "px";
  }

  // ---- charts -------------------------------------------------------------------------------------------
  function chart(canvas, now, series, fixedMax) {
    const width = Math.max(100, canvas.clientWidth), height = canvas.clientHeight || 110;
    if (canvas.width !== width || canvas.height !== height) { canvas.width = width; canvas.height = height; }
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, width, height);
    const left = 44, right = 6, top = 14, bottom = 16;
    const plotW = width - left - right, plotH = height - top - bottom;
    let max = fixedMax || 0;
    if (!fixedMax) for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
    max = niceCeil(max);
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = "#6b7280";
    ctx.strokeStyle = "#e5e7eb";
    ctx.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      const y = top + plotH * (1 - f) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(width - right, y); ctx.stroke();
      ctx.textAlign = "right";
      ctx.fillText(fmt(max * f, max < 1 ? 3 : 1), left - 4, y + 3);
    }
    ctx.textAlign = "left";
    ctx.fillText(`-${SPAN_S / 60} min`, left, height - 3);
    ctx.textAlign = "right";
    ctx.fillText("now", width - right, height - 3);
    const xOf = (t) => left + plotW * (1 - (now - t) / SPAN_S);
    const yOf = (v) => top + plotH * (1 - v / max);
    let lx = left + 4;
    series.forEach((s, k) => {
      ctx.strokeStyle = ctx.fillStyle = LINE[k % LINE.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      for (let i = 0; i < s.values.length; i++) {
        const t = s.time[i], v = s.values[i];
        if (v === null || t === undefined || now - t > SPAN_S) { pen = false; continue; }
        if (pen) ctx.lineTo(xOf(t), yOf(v)); else ctx.moveTo(xOf(t), yOf(v));
        pen = true;
      }
      ctx.stroke();
      ctx.textAlign = "left";
      ctx.fillText(s.label, lx, 10);
      lx += ctx.measureText(s.label).width + 12;
    });
  }

  function niceCeil(x) {
    if (!(x > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(x)));
    for (const m of [1, 2, 2.5, 5, 10]) if (x <= m * p) return m * p;
    return 10 * p;
  }

  function fmt(x, digits) {
    if (x === null || x === undefined) return "–";
    return x.toFixed(digits === undefined ? (Math.abs(x) >= 100 ? 0 : 1) : digits);
  }

  function hex(color) {
    return [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16));
  }

  function escape(text) {
    const d = document.createElement("div");
    d.textContent = text;
    return d.innerHTML;
  }

  poll();
})();
