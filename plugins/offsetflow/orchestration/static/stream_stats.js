// OffsetFlow "Streaming statistics" page: draws each metric's timeline and histogram with
// Chart.js (vendored next to this file) from the JSON the server put in #stats-data.
// No data is fetched: what is drawn is exactly what the page was rendered with.
"use strict";
(function () {
  const COLORS = { scheduled: "#1d5fb8", replay: "#c2410c", backfill: "#6d28d9" };
  const FAILED = "#b42318";
  const data = JSON.parse(document.getElementById("stats-data").textContent);
  Chart.defaults.font.family = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
  Chart.defaults.font.size = 11;
  Chart.defaults.color = "#5a6475";
  Chart.defaults.animation = false;
  Chart.defaults.maintainAspectRatio = false;

  function fmt(v, unit) {
    if (v === null || v === undefined) return "-";
    const n = Number(v);
    const s = Math.abs(n) >= 100 ? n.toLocaleString("en", { maximumFractionDigits: 0 })
      : n.toPrecision(3);
    return unit === "s" ? s + " s" : s + " " + unit;
  }

  for (const m of data.metrics) {
    const colors = m.kinds.map((k, i) => (m.failed[i] ? FAILED : COLORS[k] || "#1d5fb8"));
    const timeline = document.getElementById("timeline-" + m.key);
    new Chart(timeline, {
      type: "line",
      data: {
        labels: m.labels,
        datasets: [{
          label: m.title, data: m.values, borderColor: "#9bb8e0", borderWidth: 1.5,
          pointBackgroundColor: colors, pointBorderColor: colors,
          pointRadius: m.kinds.map((k, i) => (k !== "scheduled" || m.failed[i] ? 4.5 : 2.5)),
          tension: 0,
        }],
      },
      options: {
        plugins: {
          legend: { display: false },
          tooltip: {
            callbacks: {
              title: (items) => "batch #" + m.batch_ids[items[0].dataIndex] + " (" +
                m.kinds[items[0].dataIndex] + (m.failed[items[0].dataIndex]
                  ? ", after a failed attempt" : "") + ")",
              label: (item) => m.title + ": " + fmt(item.raw, m.unit),
            },
          },
        },
        scales: {
          x: { ticks: { maxTicksLimit: 8, maxRotation: 0 } },
          y: { beginAtZero: true, title: { display: true, text: m.unit } },
        },
      },
    });
    const hist = document.getElementById("histogram-" + m.key);
    new Chart(hist, {
      type: "bar",
      data: {
        labels: m.bins,
        datasets: [{ label: "batches", data: m.counts, backgroundColor: "#7ea6dc",
                     borderColor: "#1d5fb8", borderWidth: 1, barPercentage: 1,
                     categoryPercentage: 0.95 }],
      },
      options: {
        plugins: { legend: { display: false } },
        scales: {
          x: { ticks: { maxRotation: 0, autoSkip: true, maxTicksLimit: 5 } },
          y: { beginAtZero: true, ticks: { precision: 0 },
               title: { display: true, text: "batches" } },
        },
      },
    });
  }
  document.body.dataset.chartsReady = "true";
})();
