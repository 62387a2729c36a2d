// dramatiq-pg-fenced dashboard: light or dark.  By default the system's choice (prefers-color-scheme);
// the header's button picks the other one, remembered in this browser (localStorage), until picked again.
// Loaded in <head> without defer, so the page is drawn in the remembered theme from the start.
(function () {
  "use strict";
  var KEY = "dramatiq-pg-fenced-theme";
  var root = document.documentElement;
  var system = window.matchMedia ? window.matchMedia("(prefers-color-scheme: dark)") : null;
  var chosen = null;
  try { chosen = window.localStorage.getItem(KEY); } catch (e) { /* storage off: the system's */ }
  if (chosen !== "light" && chosen !== "dark") chosen = null;

  function current() { return chosen || (system && system.matches ? "dark" : "light"); }

  function apply() {
    root.setAttribute("data-theme", current());
    var button = document.getElementById("theme-toggle");
    if (button) {
      var other = current() === "dark" ? "light" : "dark";
      button.textContent = other === "dark" ? "Dark" : "Light";
      button.setAttribute("title", "Switch to the " + other + " theme (remembered in this browser)");
      button.setAttribute("aria-label", "Switch to the " + other + " theme");
    }
  }

  apply();
  if (system && system.addEventListener) system.addEventListener("change", apply);
  document.addEventListener("DOMContentLoaded", function () {
    var button = document.getElementById("theme-toggle");
    if (!button) return;
    button.hidden = false;
    button.addEventListener("click", function () {
      chosen = current() === "dark" ? "light" : "dark";
      try { window.localStorage.setItem(KEY, chosen); } catch (e) { /* not remembered */ }
      apply();
    });
    apply();
  });
})();
