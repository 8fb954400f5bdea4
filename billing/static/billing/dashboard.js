// Draws the billing dashboards' charts: each figure (data and layout, built by
// billing/views.py) comes as JSON in the page, and plotly.js (our own static copy of the
// plotly wheel's bundle) draws it into the element of the same id.
(function () {
  "use strict";
  function draw() {
    var source = document.getElementById("billing-charts");
    if (!source || typeof Plotly === "undefined") {
      return;
    }
    JSON.parse(source.textContent).forEach(function (figure) {
      var element = document.getElementById(figure.id);
      if (!element) {
        return;
      }
      if (!figure.data.length) {
        element.textContent = figure.layout.title.text + ": no data in this period.";
        element.classList.add("empty");
        return;
      }
      Plotly.newPlot(element, figure.data, figure.layout, { responsive: true, displaylogo: false });
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", draw);
  } else {
    draw();
  }
})();
