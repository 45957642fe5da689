// The job page's log: follows /ui/jobs/<id>/log (server-sent events) into <pre id="log">.
// The server resumes from the last event's id when the browser reconnects.
(function () {
  "use strict";
  var pre = document.getElementById("log");
  if (!pre || !window.EventSource) { return; }
  var status = document.getElementById("log-status");
  var source = new EventSource(pre.getAttribute("data-src"));
  source.onmessage = function (event) {
    var atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.textContent += JSON.parse(event.data);
    if (atEnd) { pre.scrollTop = pre.scrollHeight; }
  };
  source.addEventListener("end", function () {
    source.close();
    if (status) { status.textContent = "The job has ended; this is its whole log."; }
  });
})();
