// correlation-worker console: refreshes every element marked data-refresh="URL" every data-every
// milliseconds with the HTML fragment the server renders at URL (escaped there). No build step.
(function () {
  "use strict";
  document.querySelectorAll("[data-refresh]").forEach(function (element) {
    var every = parseInt(element.getAttribute("data-every") || "3000", 10);
    setInterval(function () {
      fetch(element.getAttribute("data-refresh"), { credentials: "same-origin", cache: "no-store" })
        .then(function (response) {
          if (response.redirected) { window.location.reload(); return null; }  // the session ended
          return response.ok ? response.text() : null;
        })
        .then(function (html) {
          if (html !== null) {
            element.innerHTML = html;
            element.setAttribute("data-updated", String(Date.now()));
          }
        })
        .catch(function () { /* the replica is restarting: try again at the next tick */ });
    }, every);
  });
})();
