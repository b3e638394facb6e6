// Stacked bar charts of tokens and cost over time, one colour per tenant or model.
const TOLLGATE_COLOURS = ["#2456c7", "#e07b39", "#2f9e6e", "#a23fb5", "#c43d4b", "#4aa3c7", "#8a6d3b", "#5b6270"];

// Money as the console prints it everywhere (console/templatetags/console.py, money_text):
// thousands separators, at least two decimals, up to nine, never an exponent.
function tollgateMoney(value) {
  return Number(value).toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 9 });
}

function tollgateCount(value) {
  return Number(value).toLocaleString("en-US", { maximumFractionDigits: 0 });
}

function tollgateUsageCharts(id) {
  const series = JSON.parse(document.getElementById(id).textContent);
  const make = (suffix, sets, unit, format) => {
    const canvas = document.getElementById(`${id}-${suffix}`);
    if (!canvas || !window.Chart) return;
    new Chart(canvas, {
      type: "bar",
      data: {
        labels: series.labels,
        datasets: sets.map((set, i) => ({ label: set.label, data: set.data, backgroundColor: TOLLGATE_COLOURS[i % TOLLGATE_COLOURS.length], stack: "s" })),
      },
      options: {
        responsive: true, maintainAspectRatio: false, animation: false,
        scales: {
          x: { stacked: true },
          y: { stacked: true, beginAtZero: true, title: { display: true, text: unit }, ticks: { callback: (value) => format(value) } },
        },
        plugins: {
          legend: { position: "bottom" },
          tooltip: { callbacks: { label: (ctx) => `${ctx.dataset.label}: ${format(ctx.parsed.y)} ${unit}` } },
        },
      },
    });
  };
  make("tokens", series.tokens, "tokens", tollgateCount);
  make("cost", series.cost, series.currency || "money", tollgateMoney);
}
