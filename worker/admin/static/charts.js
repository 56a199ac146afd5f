// correlation-worker console: the overview's charts. Reads the series the server computes from the samples in
// the database (the same on every replica) every data-every milliseconds and redraws them in place with uPlot
// (served by the worker itself: no CDN). Each figure.chart names its series (data-series) and their labels;
// "*calls_per_replica" draws one line per replica. After each update a figure carries data-latest (the newest
// value of each series, JSON) and data-points (how many steps hold a value), for people and tests alike.
(function () {
  "use strict";
  var section = document.getElementById("charts");
  if (!section || typeof uPlot === "undefined") { return; }
  var every = parseInt(section.getAttribute("data-every") || "5000", 10);
  var source = section.getAttribute("data-source");
  var windowName = "1h";
  var plots = {};  // figure id -> {plot, key}
  var palette = ["#2563eb", "#16a34a", "#d97706", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];

  function seriesOf(figure, data) {
    var wanted = figure.getAttribute("data-series");
    if (wanted === "*calls_per_replica") {
      var names = Object.keys(data.calls_per_replica || {}).sort();
      return names.map(function (name) { return { label: name, values: data.calls_per_replica[name] }; });
    }
    var labels = (figure.getAttribute("data-labels") || "").split(",");
    return wanted.split(",").map(function (name, index) {
      return { label: labels[index] || name, values: data.series[name] || [] };
    });
  }

  // An axis label that always fits its axis: 950, 12.5k, 100k, 1.2M, 3G (never "00,000" cut from 100,000).
  function compact(value) {
    if (value === null || value === undefined) { return ""; }
    var size = Math.abs(value);
    var units = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (var i = 0; i < units.length; i++) {
      if (size >= units[i][0]) {
        var scaled = value / units[i][0];
        var tenths = Math.abs(scaled) < 100 ? 10 : 1;
        return String(Math.round(scaled * tenths) / tenths) + units[i][1];
      }
    }
    return String(Math.round(value * 100) / 100);
  }

  function latest(values) {
    for (var i = values.length - 1; i >= 0; i--) { if (values[i] !== null && values[i] !== undefined) { return values[i]; } }
    return null;
  }

  function draw(figure, data) {
    var lines = seriesOf(figure, data);
    var key = windowName + "|" + lines.map(function (l) { return l.label; }).join(",");
    var aligned = [data.at].concat(lines.map(function (l) { return l.values; }));
    var entry = plots[figure.id];
    if (entry && entry.key !== key) { entry.plot.destroy(); entry = null; }
    if (!entry) {
      var options = {
        width: Math.max(280, figure.clientWidth - 8),
        height: 170,
        legend: { show: true },
        cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true } },
        axes: [{}, { size: 56, values: function (u, splits) { return splits.map(compact); } }],
        series: [{}].concat(lines.map(function (l, index) {
          var color = palette[index % palette.length];
          return { label: l.label, stroke: color, width: 1.5, spanGaps: false, points: { show: true, size: 3, fill: color } };
        })),
      };
      entry = { plot: new uPlot(options, aligned, figure), key: key };
      plots[figure.id] = entry;
    } else {
      entry.plot.setData(aligned);
    }
    var shown = {};
    var points = 0;
    lines.forEach(function (l) {
      shown[l.label] = latest(l.values);
      points = Math.max(points, l.values.filter(function (v) { return v !== null; }).length);
    });
    figure.setAttribute("data-latest", JSON.stringify(shown));
    figure.setAttribute("data-points", String(points));
    figure.setAttribute("data-updated", String(Date.now()));
  }

  function refresh() {
    fetch(source + "?window=" + encodeURIComponent(windowName), { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        if (response.redirected) { window.location.reload(); return null; }  // the session ended
        return response.ok ? response.json() : null;
      })
      .then(function (data) {
        if (!data) { return; }
        section.querySelectorAll("figure.chart").forEach(function (figure) { draw(figure, data); });
        section.setAttribute("data-window", windowName);
      })
      .catch(function () { /* the replica is restarting: try again at the next tick */ });
  }

  section.querySelectorAll("[data-window]").forEach(function (button) {
    if (button.tagName !== "BUTTON") { return; }
    button.addEventListener("click", function () {
      windowName = button.getAttribute("data-window");
      section.querySelectorAll("button[data-window]").forEach(function (b) { b.classList.toggle("on", b === button); });
      refresh();
    });
  });
  refresh();
  setInterval(refresh, every);
})();
