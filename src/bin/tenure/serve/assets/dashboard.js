// tenure serve: the one script. It reloads the page every 5 seconds while "auto-refresh" is
// ticked (remembered in this browser), and does nothing else.
(function () {
  var box = document.getElementById("auto-refresh");
  if (!box) { return; }
  var key = "tenure-auto-refresh";
  box.checked = window.localStorage.getItem(key) === "on";
  var timer = null;
  function arm() {
    if (timer) { window.clearTimeout(timer); timer = null; }
    if (box.checked) { timer = window.setTimeout(function () { window.location.reload(); }, 5000); }
  }
  box.addEventListener("change", function () {
    window.localStorage.setItem(key, box.checked ? "on" : "off");
    arm();
  });
  arm();
})();
