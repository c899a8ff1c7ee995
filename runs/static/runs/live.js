// A running run's page: each event of its stream appears as a line of progress; at the end
// of the stream the page loads again, with the result.
(function () {
  var script = document.currentScript;
  var source = new EventSource(script.dataset.stream);
  var list = document.getElementById("progress");
  source.addEventListener("end", function () {
    source.close();
    window.location.reload();
  });
  JSON.parse(document.getElementById("event-types").textContent).forEach(function (type) {
    source.addEventListener(type, function () {
      var item = document.createElement("li");
      item.textContent = "in progress: " + type;
      list.appendChild(item);
    });
  });
})();
