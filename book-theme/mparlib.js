// Course book additions: the Pagefind search box in the bar on top of every page, and "/" or "s" to focus it.
// Loaded by mdBook from <book>/book-theme/mparlib.js, so the book's root is one folder up from this file.
(function () {
  "use strict";
  var root = new URL("..", document.currentScript.src);
  var slot = document.querySelector(".mparlib-bar .mparlib-search");
  if (!slot) return;
  if (location.protocol === "file:") {
    slot.textContent = slot.closest(".mparlib-bar").getAttribute("data-no-search");
    slot.classList.add("mparlib-search-off");
    return;
  }
  var css = document.createElement("link");
  css.rel = "stylesheet";
  css.href = new URL("pagefind/pagefind-ui.css", root).href;
  document.head.appendChild(css);
  var script = document.createElement("script");
  script.src = new URL("pagefind/pagefind-ui.js", root).href;
  script.onload = function () {
    new PagefindUI({
      element: slot,
      bundlePath: new URL("pagefind/", root).pathname,
      baseUrl: root.pathname,
      showSubResults: true,
      showImages: false,
      resetStyles: false,
    });
  };
  document.head.appendChild(script);
  slot.addEventListener("keydown", function (e) {  // Esc empties the box, which closes the results
    if (e.key === "Escape" && e.target.tagName === "INPUT" && e.target.value) {
      e.target.value = "";
      e.target.dispatchEvent(new Event("input", { bubbles: true }));
    }
  });
  document.addEventListener("keydown", function (e) {
    var t = e.target;
    if (e.ctrlKey || e.metaKey || e.altKey || (t && (t.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(t.tagName)))) return;
    if (e.key === "/" || e.key === "s") {
      var input = slot.querySelector("input");
      if (input) { e.preventDefault(); input.focus(); }
    }
  });
})();
