// dramatiq-pg-fenced dashboard: keeps the page current without a reload.
// Every few seconds (the body's data-live, in seconds) it fetches this page again and swaps the
// content of <div id=content> for the fresh one; never while a field in it has the focus, was changed
// and not submitted, or a row is selected, nor while the tab is hidden.  The header's button pauses and resumes it (remembered in
// this browser).  No library, no build: the file is served as is from the package.
(function () {
  "use strict";
  var body = document.body;
  var content = document.getElementById("content");
  var toggle = document.getElementById("live-toggle");
  var status = document.getElementById("live-status");
  var every = Number(body.getAttribute("data-live") || 0) * 1000;
  if (!content || !toggle || !every) return;
  var KEY = "dramatiq-pg-fenced-live-paused";
  var paused = false;
  try { paused = window.localStorage.getItem(KEY) === "1"; } catch (e) { /* storage off: not remembered */ }
  var timer = null;
  var updates = 0;

  function show(text) {
    toggle.textContent = paused ? "Resume live" : "Pause live";
    toggle.setAttribute("aria-pressed", paused ? "true" : "false");
    body.setAttribute("data-paused", paused ? "1" : "0");
    if (status) status.textContent = paused ? "paused" : (text || status.textContent || "live");
  }

  function busy() {
    var active = document.activeElement;
    if (active && active !== body && content.contains(active) && /^(INPUT|SELECT|TEXTAREA)$/.test(active.tagName)) {
      return true;
    }
    return content.querySelector("input[type=checkbox]:checked") !== null || edited();
  }

  function edited() {  // a field changed and not yet submitted: an update would undo it
    var fields = content.querySelectorAll("input, select, textarea");
    for (var i = 0; i < fields.length; i++) {
      var f = fields[i];
      if (f.tagName === "SELECT") {
        var initial = 0; // a single select without a selected option starts on its first
        for (var j = 0; j < f.options.length; j++) {
          if (f.options[j].defaultSelected) initial = j;
        }
        if (f.selectedIndex !== initial) return true;
      } else if (f.type === "checkbox" || f.type === "radio") {
        if (f.checked !== f.defaultChecked) return true;
      } else if (f.type !== "hidden" && f.value !== f.defaultValue) {
        return true;
      }
    }
    return false;
  }

  function schedule() {
    if (timer === null && !paused) timer = window.setTimeout(poll, every);
  }

  function poll() {
    timer = null;
    if (paused) return;
    if (document.hidden || busy()) { schedule(); return; }
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store", headers: { "X-Dashboard-Live": "1" } })
      .then(function (response) {
        if (!response.ok) throw new Error(String(response.status));
        return response.text();
      })
      .then(function (text) {
        if (paused || busy()) return;
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.getElementById("content");
        if (fresh === null) throw new Error("no content"); // a login page, say: leave this one as it is
        content.replaceChildren.apply(content, Array.prototype.slice.call(document.adoptNode(fresh).childNodes));
        var heading = document.querySelector("main > h1"), freshHeading = doc.querySelector("main > h1");
        if (heading && freshHeading) heading.textContent = freshHeading.textContent;
        document.title = doc.title;
        updates += 1;
        body.setAttribute("data-updates", String(updates));
        show("updated " + new Date().toLocaleTimeString());
      })
      .catch(function () { show("not updated (server unreachable?)"); })
      .then(schedule);
  }

  toggle.addEventListener("click", function () {
    paused = !paused;
    try { window.localStorage.setItem(KEY, paused ? "1" : "0"); } catch (e) { /* not remembered */ }
    if (timer !== null) { window.clearTimeout(timer); timer = null; }
    show(paused ? "paused" : "live");
    schedule();
  });
  document.addEventListener("visibilitychange", function () { if (!document.hidden) schedule(); });
  toggle.hidden = false;
  show(paused ? "paused" : "live");
  schedule();
})();
