// A running run's page: each event of its stream after those the page shows appears as a
// line of progress, its type and when it happened; at the end of the stream the page loads
// again, with the result. A reconnecting browser sends Last-Event-ID, which the stream
// follows on from instead of `after`.
(function () {
  var script = document.currentScript;
  var source = new EventSource(
    script.dataset.stream + "?after=" + encodeURIComponent(script.dataset.after)
  );
  var list = document.getElementById("progress");
  source.addEventListener("end", function () {
    source.close();
    window.location.reload();
  });
  JSON.parse(document.getElementById("event-types").textContent).forEach(function (type) {
    source.addEventListener(type, function (message) {
      var event = JSON.parse(message.data);
      var item = document.createElement("li");
      item.textContent = event.type + " at " + event.created_at;
      list.appendChild(item);
    });
  });
})();
