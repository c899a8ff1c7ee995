// The periodic task form of the admin: the crontab's help says what the chosen schedule means,
// and the field that only repeats it stays hidden.
(function () {
  var readable = JSON.parse(document.getElementById("readable-crontabs").textContent);
  var help = JSON.parse(document.getElementById("crontab-help").textContent);
  document.querySelectorAll(".field-crontab_translation").forEach(function (row) {
    row.style.display = "none";
  });
  var field = document.querySelector(".field-crontab");
  if (!field) {
    return;
  }
  field.addEventListener("change", function () {
    var shown = field.querySelector(".help");
    var chosen = document.getElementById("id_crontab");
    if (!shown || !chosen) {
      return;
    }
    shown.textContent = help;
    shown.appendChild(document.createElement("br"));
    shown.appendChild(document.createTextNode("Translation: " + (readable[chosen.value] || "")));
  });
})();
