/* The report's stream viewer (beatflow.report.viewer holds the data's layout and why it is hand-written).
   Reads the JSON of #bf-viewer-data, draws the stream on a canvas: the pyramid level of about one bin per
   pixel folded into pixel columns (each drawn from its minimum to its maximum), the raw samples where the
   page holds them and the view is finer than the finest level, the beats (class, flagged), the unreadable
   stretches. window.bfViewer exposes the state (the visible range) and the moves. */
(function () {
  "use strict";
  var root = document.getElementById("bf-viewer");
  var src = document.getElementById("bf-viewer-data");
  if (!root || !src) return;
  var started = performance.now();
  var D = JSON.parse(src.textContent);

  function bytes(b64) {
    var s = atob(b64), n = s.length, u = new Uint8Array(n);
    for (var i = 0; i < n; i++) u[i] = s.charCodeAt(i);
    return u;
  }
  function typed(b64, Kind) {
    var u = bytes(b64);
    return new Kind(u.buffer, 0, u.length / Kind.BYTES_PER_ELEMENT);
  }

  var total = D.total, fs = D.fs, off = D.off, scale = D.scale, rscale = D.raw_scale;
  var levels = D.levels.map(function (L) {
    return { n: L.n, lo: typed(L.lo, Int8Array), hi: typed(L.hi, Int8Array), w: total / L.n };
  });
  var rawStart = typed(D.raw.start, Uint32Array), rawLen = typed(D.raw.len, Uint32Array);
  var rawData = typed(D.raw.data, Int16Array), rawAt = new Float64Array(rawLen.length + 1);
  for (var r = 0; r < rawLen.length; r++) rawAt[r + 1] = rawAt[r] + rawLen[r];
  var beatStart = typed(D.beats.start, Uint32Array), beatCode = typed(D.beats.code, Uint8Array);
  var COLORS = ["#8a939e", "#1565c0", "#c62828"], NAMES = ["N", "S", "V"];
  var MIN_SPAN = Math.max(8, Math.round(fs / 4));  // a quarter of a second: one beat fills the view

  var main = root.querySelector("canvas.bf-main"), over = root.querySelector("canvas.bf-over");
  var info = root.querySelector(".bf-info");
  var S = { t0: 0, t1: total, t0_s: 0, t1_s: total / fs, span_s: total / fs, level: -1, bin_samples: 0,
            raw: false, beats_in_view: 0, draws: 0, first_draw_ms: null, setup_ms: null, selected: null };

  function lowerBound(a, v) {  // the first index with a[i] >= v (a sorted)
    var lo = 0, hi = a.length;
    while (lo < hi) { var m = (lo + hi) >> 1; if (a[m] < v) lo = m + 1; else hi = m; }
    return lo;
  }
  function hms(sec, step) {
    var neg = sec < 0; sec = Math.abs(sec);
    var h = Math.floor(sec / 3600), m = Math.floor((sec % 3600) / 60), s = sec % 60;
    var ss = step < 1 ? s.toFixed(step < 0.1 ? 2 : 1) : String(Math.floor(s + 1e-9));
    if (s < 10) ss = "0" + ss;
    return (neg ? "-" : "") + h + ":" + (m < 10 ? "0" : "") + m + ":" + ss;
  }
  var STEPS = [0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400];

  function clampView(t0, t1) {
    var span = Math.min(total, Math.max(MIN_SPAN, t1 - t0));
    var c = (t0 + t1) / 2;
    t0 = c - span / 2;
    if (t0 < 0) t0 = 0;
    if (t0 + span > total) t0 = total - span;
    S.t0 = t0; S.t1 = t0 + span;
  }

  function size(cv) {
    var dpr = window.devicePixelRatio || 1, w = cv.clientWidth, h = cv.clientHeight;
    if (cv.width !== Math.round(w * dpr) || cv.height !== Math.round(h * dpr)) {
      cv.width = Math.round(w * dpr); cv.height = Math.round(h * dpr);
    }
    var g = cv.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { g: g, w: w, h: h };
  }

  // the pixel columns' minima and maxima over [t0, t1) from level L (bins wider than a pixel span several)
  function foldLevel(L, t0, spp, pw, cmin, cmax) {
    var j0 = Math.max(0, Math.floor(t0 / L.w) - 1), j1 = Math.min(L.n, Math.ceil((t0 + spp * pw) / L.w) + 1);
    for (var j = j0; j < j1; j++) {
      var qa = L.lo[j];
      if (qa === -128) continue;
      var a = Math.floor(j * total / L.n), b = Math.floor((j + 1) * total / L.n);
      var x0 = Math.floor((a - t0) / spp), x1 = Math.max(x0, Math.ceil((b - t0) / spp) - 1);
      if (x1 < 0 || x0 >= pw) continue;
      var lo = off + qa * scale, hi = off + L.hi[j] * scale;
      for (var x = Math.max(0, x0); x <= Math.min(pw - 1, x1); x++) {
        if (!(cmin[x] <= lo)) cmin[x] = lo;
        if (!(cmax[x] >= hi)) cmax[x] = hi;
      }
    }
  }

  function draw() {
    S.draws++;
    var c = size(main), g = c.g;
    var ml = 52, mr = 8, mt = 18, mb = 34, pw = Math.max(10, Math.floor(c.w - ml - mr)), ph = c.h - mt - mb;
    var t0 = S.t0, t1 = S.t1, spp = (t1 - t0) / pw;
    g.clearRect(0, 0, c.w, c.h);
    g.fillStyle = "#fff"; g.fillRect(0, 0, c.w, c.h);
    // the level: the coarsest whose bins are no wider than a pixel (the finest where the view is finer)
    var k = 0;
    for (var i = levels.length - 1; i >= 0; i--) if (levels[i].w <= spp) { k = i; break; }
    var L = levels[k];
    var cmin = new Float64Array(pw).fill(NaN), cmax = new Float64Array(pw).fill(NaN);
    foldLevel(L, t0, spp, pw, cmin, cmax);
    // the raw windows in view, where the finest level is coarser than the view's pixels
    var useRaw = spp < levels[0].w, rawPx = new Uint8Array(pw), lines = [];
    var rmin = new Float64Array(pw).fill(NaN), rmax = new Float64Array(pw).fill(NaN);
    S.raw = false;
    if (useRaw && rawStart.length) {
      var w0 = Math.max(0, lowerBound(rawStart, t0 + 1) - 1);
      for (var w = w0; w < rawStart.length && rawStart[w] < t1; w++) {
        var a0 = rawStart[w], n = rawLen[w];
        if (a0 + n <= t0) continue;
        var s0 = Math.max(0, Math.floor(t0) - a0 - 1), s1 = Math.min(n, Math.ceil(t1) - a0 + 1);
        if (s1 <= s0) continue;
        S.raw = true;
        var base = rawAt[w];
        if (spp < 1.5) {  // a line through the samples
          var pts = [];
          for (var s = s0; s < s1; s++) pts.push((a0 + s - t0) / spp, off + rawData[base + s] * rscale);
          lines.push(pts);
          var xa = Math.max(0, Math.floor((a0 + s0 - t0) / spp)), xb = Math.min(pw - 1, Math.floor((a0 + s1 - 1 - t0) / spp));
          for (var xx = xa; xx <= xb; xx++) {
            rawPx[xx] = 2;
          }
          for (var s2 = s0; s2 < s1; s2++) {
            var xq = Math.floor((a0 + s2 - t0) / spp), v = off + rawData[base + s2] * rscale;
            if (xq < 0 || xq >= pw) continue;
            if (!(rmin[xq] <= v)) rmin[xq] = v;
            if (!(rmax[xq] >= v)) rmax[xq] = v;
          }
        } else {
          for (var s3 = s0; s3 < s1; s3++) {
            var xr = Math.floor((a0 + s3 - t0) / spp), vr = off + rawData[base + s3] * rscale;
            if (xr < 0 || xr >= pw) continue;
            rawPx[xr] = 1;
            if (!(rmin[xr] <= vr)) rmin[xr] = vr;
            if (!(rmax[xr] >= vr)) rmax[xr] = vr;
          }
        }
      }
    }
    for (var x = 0; x < pw; x++) if (rawPx[x]) { cmin[x] = rmin[x]; cmax[x] = rmax[x]; }
    // the vertical range: what is in view
    var ylo = Infinity, yhi = -Infinity;
    for (x = 0; x < pw; x++) {
      if (cmin[x] < ylo) ylo = cmin[x];
      if (cmax[x] > yhi) yhi = cmax[x];
    }
    if (!(yhi > ylo)) { ylo = (isFinite(ylo) ? ylo : 0) - 1; yhi = ylo + 2; }
    var pad = 0.06 * (yhi - ylo); ylo -= pad; yhi += pad;
    function Y(v) { return mt + ph * (yhi - v) / (yhi - ylo); }
    function X(t) { return ml + (t - t0) / spp; }

    // unreadable stretches, recordings' starts
    g.fillStyle = "rgba(255,152,0,0.22)";
    D.unreadable.forEach(function (u) {
      if (u[1] < t0 || u[0] > t1) return;
      var xa = Math.max(ml, X(u[0])), xb = Math.min(ml + pw, X(u[1]));
      g.fillRect(xa, mt, Math.max(1, xb - xa), ph);
    });
    if (S.selected) {
      var sa = Math.max(ml, X(S.selected[0])), sb = Math.min(ml + pw, X(S.selected[1]));
      if (sb > ml && sa < ml + pw) { g.fillStyle = "rgba(255,214,0,0.35)"; g.fillRect(sa, mt, Math.max(2, sb - sa), ph); }
    }
    g.strokeStyle = "#9aa3ad"; g.setLineDash([4, 3]); g.lineWidth = 1;
    g.fillStyle = "#5a6470"; g.font = "11px system-ui, sans-serif";
    D.recordings.forEach(function (rc, ri) {
      if ((ri === 0 && D.recordings.length < 2) || rc[1] < t0 || rc[1] > t1) return;
      var xr = Math.round(X(rc[1])) + 0.5;
      g.beginPath(); g.moveTo(xr, mt); g.lineTo(xr, mt + ph); g.stroke();
      g.fillText(rc[0], xr + 3, mt + 11);
    });
    g.setLineDash([]);

    // the beats: flagged ones shaded when few are in view, ticks by class, letters when a few
    var b0 = lowerBound(beatStart, t0 - fs * 3), b1 = lowerBound(beatStart, t1);
    var nView = 0;
    for (var bi = b0; bi < b1; bi++) if (beatStart[bi] >= t0) nView++;
    S.beats_in_view = nView;
    var few = nView <= 80, some = nView <= 3000;
    for (bi = b0; bi < b1; bi++) {
      var bc = beatCode[bi], cls = bc & 3, flag = bc & 4;
      var end = bi + 1 < beatStart.length ? beatStart[bi + 1] : total;
      if (end < t0) continue;
      var xb0 = X(beatStart[bi]);
      if (flag && few) {
        g.fillStyle = "rgba(198,40,40,0.10)";
        g.fillRect(Math.max(ml, xb0), mt, Math.max(1, Math.min(ml + pw, X(end)) - Math.max(ml, xb0)), ph);
      }
      if (beatStart[bi] < t0) continue;
      if (cls || some) {
        g.fillStyle = COLORS[cls];
        g.fillRect(Math.round(xb0), mt + ph + 2, cls ? 2 : 1, cls ? 8 : 5);
      }
      if (flag && some) {
        g.fillStyle = "#c62828";
        g.beginPath(); g.moveTo(xb0 - 4, 2); g.lineTo(xb0 + 4, 2); g.lineTo(xb0, 10); g.closePath(); g.fill();
      } else if (flag) {  // (thousands in view: a thin tick each)
        g.fillStyle = "#c62828"; g.fillRect(Math.round(xb0), 3, 1, 8);
      }
      if (few) {
        g.fillStyle = COLORS[cls]; g.font = "bold 11px system-ui, sans-serif";
        g.fillText(NAMES[cls], xb0 + 12 > ml + pw ? xb0 - 8 : xb0 + 6, mt + 12);
      }
    }

    // the signal
    g.save(); g.beginPath(); g.rect(ml, mt, pw, ph); g.clip();
    g.fillStyle = "#1f3a5f";
    for (x = 0; x < pw; x++) {
      if (rawPx[x] === 2 || !(cmax[x] >= cmin[x])) continue;
      var ya = Y(cmax[x]), yb = Y(cmin[x]);
      g.fillRect(ml + x, ya, 1, Math.max(1, yb - ya));
    }
    g.strokeStyle = "#111"; g.lineWidth = 1.2;
    lines.forEach(function (pts) {
      g.beginPath();
      for (var p = 0; p < pts.length; p += 2) {
        if (p) g.lineTo(ml + pts[p], Y(pts[p + 1])); else g.moveTo(ml + pts[p], Y(pts[p + 1]));
      }
      g.stroke();
    });
    g.restore();

    // axes
    g.strokeStyle = "#c9ced4"; g.lineWidth = 1; g.strokeRect(ml + 0.5, mt + 0.5, pw - 1, ph - 1);
    g.fillStyle = "#39424c"; g.font = "11px system-ui, sans-serif"; g.textAlign = "center";
    var span = (t1 - t0) / fs, step = STEPS[STEPS.length - 1];
    for (i = 0; i < STEPS.length; i++) if (STEPS[i] * fs / spp >= 90) { step = STEPS[i]; break; }
    for (var tt = Math.ceil(t0 / fs / step) * step; tt * fs <= t1; tt += step) {
      var xt = Math.round(X(tt * fs)) + 0.5;
      g.fillRect(xt - 0.5, mt + ph + 11, 1, 4);
      if (xt > 24 && xt < c.w - 24) g.fillText(hms(tt, step), xt, mt + ph + 26);
    }
    g.textAlign = "right";
    var ystep = Math.pow(10, Math.floor(Math.log10((yhi - ylo) / 4)));
    if ((yhi - ylo) / ystep > 8) ystep *= 2;
    if ((yhi - ylo) / ystep > 8) ystep *= 2.5;
    for (var yv = Math.ceil(ylo / ystep) * ystep; yv <= yhi; yv += ystep) {
      var yy = Math.round(Y(yv)) + 0.5;
      g.fillRect(ml - 4, yy - 0.5, 4, 1);
      g.fillText(Math.abs(yv) < ystep / 2 ? "0" : yv.toPrecision(3).replace(/\.?0+$/, ""), ml - 6, yy + 4);
    }
    g.textAlign = "left";

    S.level = k; S.bin_samples = L.w;
    S.t0_s = t0 / fs; S.t1_s = t1 / fs; S.span_s = span;
    info.textContent = hms(t0 / fs, span < 10 ? 0.1 : 1) + " – " + hms(t1 / fs, span < 10 ? 0.1 : 1) +
      " (" + (span >= 120 ? (span / 60).toFixed(1) + " min" : span.toFixed(span < 10 ? 2 : 1) + " s") + "), " +
      nView.toLocaleString("en") + " beats; min/max of " + Math.round(L.w).toLocaleString("en") +
      " samples per bin" + (S.raw ? ", raw samples where held" : "");
    drawOverview();
    if (S.first_draw_ms === null) { S.first_draw_ms = performance.now(); S.setup_ms = S.first_draw_ms - started; }
  }

  function drawOverview() {
    var c = size(over), g = c.g, ml = 52, pw = Math.max(10, c.w - ml - 8), h = c.h;
    var L = levels[levels.length - 1], spp = total / pw;
    var cmin = new Float64Array(pw).fill(NaN), cmax = new Float64Array(pw).fill(NaN);
    foldLevel(L, 0, spp, pw, cmin, cmax);
    var lo = off - 127 * scale, hi = off + 127 * scale;
    g.clearRect(0, 0, c.w, h); g.fillStyle = "#f7f8fa"; g.fillRect(ml, 0, pw, h);
    g.fillStyle = "rgba(255,152,0,0.45)";
    D.unreadable.forEach(function (u) { g.fillRect(ml + u[0] / spp, 0, Math.max(1, (u[1] - u[0]) / spp), h); });
    g.fillStyle = "#7d8b99";
    for (var x = 0; x < pw; x++) {
      if (!(cmax[x] >= cmin[x])) continue;
      var ya = (h - 6) * (hi - cmax[x]) / (hi - lo), yb = (h - 6) * (hi - cmin[x]) / (hi - lo);
      g.fillRect(ml + x, ya, 1, Math.max(1, yb - ya));
    }
    g.fillStyle = "#c62828";
    var last = -1;
    for (var b = 0; b < beatStart.length; b++) {
      if (!(beatCode[b] & 4)) continue;
      var xb = Math.floor(ml + beatStart[b] / spp);
      if (xb !== last) { g.fillRect(xb, h - 5, 1, 5); last = xb; }
    }
    var xa = ml + S.t0 / spp, xw = Math.max(3, (S.t1 - S.t0) / spp);
    g.fillStyle = "rgba(21,101,192,0.15)"; g.fillRect(xa, 0, xw, h);
    g.strokeStyle = "#1565c0"; g.lineWidth = 1.5; g.strokeRect(xa + 0.5, 0.75, xw - 1, h - 1.5);
  }

  var pending = false;
  function redraw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; draw(); });
  }
  function plotX(ev) {  // an event's position on the time axis
    var r = main.getBoundingClientRect(), pw = Math.max(10, Math.floor(r.width - 60));
    var f = Math.min(1, Math.max(0, (ev.clientX - r.left - 52) / pw));
    return S.t0 + f * (S.t1 - S.t0);
  }
  function zoom(factor, at) {  // the span times factor, the time at stays where it is on screen
    if (at === undefined) at = (S.t0 + S.t1) / 2;
    var f = (at - S.t0) / (S.t1 - S.t0), span = (S.t1 - S.t0) * factor;
    clampView(at - f * span, at - f * span + span);
    redraw();
  }
  function pan(frac) { var span = S.t1 - S.t0; clampView(S.t0 + frac * span, S.t1 + frac * span); redraw(); }
  function goTo(a, b, selected) {
    S.selected = selected || null;
    clampView(a, b);
    redraw();
  }
  function reset() { S.selected = null; clampView(0, total); redraw(); }

  main.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    zoom(Math.pow(1.0015, ev.deltaY), plotX(ev));
  }, { passive: false });
  var drag = null;
  main.addEventListener("mousedown", function (ev) { drag = { x: ev.clientX, t0: S.t0, t1: S.t1 }; });
  window.addEventListener("mouseup", function () { drag = null; });
  window.addEventListener("mousemove", function (ev) {
    if (!drag) return;
    var pw = Math.max(10, main.clientWidth - 60), dt = (ev.clientX - drag.x) * (drag.t1 - drag.t0) / pw;
    clampView(drag.t0 - dt, drag.t1 - dt);
    redraw();
  });
  main.addEventListener("dblclick", function (ev) { zoom(0.25, plotX(ev)); });
  over.addEventListener("click", function (ev) {
    var r = over.getBoundingClientRect(), pw = Math.max(10, r.width - 60);
    var t = Math.min(1, Math.max(0, (ev.clientX - r.left - 52) / pw)) * total, span = S.t1 - S.t0;
    clampView(t - span / 2, t + span / 2);
    redraw();
  });
  root.querySelectorAll("button[data-act]").forEach(function (btn) {
    btn.addEventListener("click", function () {
      var a = btn.getAttribute("data-act");
      if (a === "in") zoom(0.5); else if (a === "out") zoom(2); else if (a === "left") pan(-0.5);
      else if (a === "right") pan(0.5); else if (a === "all") reset();
      else if (a === "beat") zoom(1.5 * fs / (S.t1 - S.t0));
    });
  });
  // the top anomalies' table: a row's click shows its beat, a second before and after it
  document.querySelectorAll("tr[data-top]").forEach(function (tr) {
    tr.addEventListener("click", function () {
      var p = D.top[+tr.getAttribute("data-top")];
      if (!p) return;
      document.querySelectorAll("tr.bf-on").forEach(function (o) { o.classList.remove("bf-on"); });
      tr.classList.add("bf-on");
      goTo(p[0] - fs, p[0] + p[1] + fs, [p[0], p[0] + p[1]]);
      root.scrollIntoView({ block: "start" });
    });
  });
  window.addEventListener("resize", redraw);

  window.bfViewer = { state: S, zoom: zoom, pan: pan, goTo: goTo, reset: reset, draw: draw,
                      levels: levels.map(function (L) { return L.n; }) };
  draw();
})();
