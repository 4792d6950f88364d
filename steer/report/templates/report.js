// The report's few interactions, with no library: sortable tables, the sweep's prompt picker, the heat map's cells.
(function () {
  "use strict";
  function cellValue(td, type) {
    var v = td.getAttribute("data-v");
    if (v === null) v = td.textContent;
    if (type === "text") return { t: v };
    var n = parseFloat(v);
    if (type === "num" || (type === "auto" && v !== "" && !isNaN(n) && String(n) !== "NaN" && /^-?[\d.]+(e-?\d+)?$/i.test(v.trim()))) {
      return isNaN(n) ? { missing: true } : { n: n };
    }
    return { t: v };
  }
  function compare(a, b) {
    if (a.missing || b.missing) return a.missing === b.missing ? 0 : (a.missing ? 1 : -1);
    if (a.n !== undefined && b.n !== undefined) return a.n - b.n;
    return String(a.t !== undefined ? a.t : a.n).localeCompare(String(b.t !== undefined ? b.t : b.n), undefined, { numeric: true });
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    var heads = table.querySelectorAll("thead th");
    heads.forEach(function (th) {
      var button = th.querySelector("button");
      if (!button) return;
      button.addEventListener("click", function () {
        var col = parseInt(button.getAttribute("data-col"), 10), type = button.getAttribute("data-type");
        var dir = th.getAttribute("aria-sort") === "ascending" ? "descending" : "ascending";
        heads.forEach(function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", dir);
        var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (r1, r2) {
          var a = cellValue(r1.cells[col], type), b = cellValue(r2.cells[col], type);
          var c = compare(a, b);
          if (a.missing || b.missing) return c;  // rows without a value stay last either way
          return dir === "ascending" ? c : -c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
  var pick = document.getElementById("prompt-pick");
  if (pick) {
    pick.addEventListener("change", function () {
      document.querySelectorAll(".textview").forEach(function (v) {
        v.hidden = v.getAttribute("data-prompt") !== pick.value;
      });
    });
  }
  var cells = document.querySelectorAll("button.cell");
  cells.forEach(function (b) {
    b.addEventListener("click", function () {
      var name = b.getAttribute("data-cell");
      cells.forEach(function (o) { o.setAttribute("aria-pressed", o === b ? "true" : "false"); });
      document.querySelectorAll(".cellview").forEach(function (v) { v.hidden = v.getAttribute("data-cell") !== name; });
      var hint = document.getElementById("cell-hint");
      if (hint) hint.hidden = true;
    });
  });
})();
