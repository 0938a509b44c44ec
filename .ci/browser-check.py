#!/usr/bin/env python3
"""Checks the generated contract page in a real browser (headless Chromium).

Usage: browser-check.py PAGE.html

Fails (exit 1) unless, at a laptop's 1366x768 window: the page renders (a title,
its tables, the retry timeline drawn with a size), no table and nothing else makes
the page wider than the window, and the page fetched nothing (no resource loads at
all, and no reference to an outside stylesheet, script, image or font in its HTML).
"""
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

PROBE = """
<script>
window.addEventListener('load', () => {
  const w = window.innerWidth;
  const tables = [...document.querySelectorAll('table')];
  const svg = document.querySelector('svg.timeline');
  const box = svg ? svg.getBoundingClientRect() : null;
  const wide = tables.filter(t => t.getBoundingClientRect().right > w + 0.5).length;
  const result = {
    width: w,
    scrollWidth: document.documentElement.scrollWidth,
    h1: !!document.querySelector('h1'),
    tables: tables.length,
    tablesWiderThanWindow: wide,
    svgWidth: box ? box.width : 0,
    svgHeight: box ? box.height : 0,
    styled: getComputedStyle(document.querySelector('table') || document.body).borderCollapse === 'collapse',
    resources: performance.getEntriesByType('resource').map(e => e.name),
  };
  const out = document.createElement('pre');
  out.id = 'browser-check';
  out.textContent = JSON.stringify(result);
  document.body.appendChild(out);
});
</script>
"""


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("browser-check: no chromium on PATH (apt-get install chromium)")


def main():
    page = open(sys.argv[1], encoding="utf-8").read()
    failures = []
    # Nothing outside may be loaded: no stylesheet, script, image, frame or font.
    for m in re.finditer(r'<(link|script|img|iframe|source|video|audio)\b[^>]*>', page, re.I):
        failures.append(f"the page loads an outside resource: {m.group(0)[:120]}")
    if re.search(r'url\(\s*["\']?(https?:)?//', page, re.I):
        failures.append("the stylesheet references an outside url()")
    with tempfile.TemporaryDirectory() as tmp:
        probe_path = os.path.join(tmp, "page.html")
        with open(probe_path, "w", encoding="utf-8") as f:
            f.write(page.replace("</body>", PROBE + "</body>"))
        cmd = [
            chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={tmp}/profile", "--window-size=1366,768",
            "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=5000",
            "--dump-dom", "file://" + probe_path,
        ]
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    m = re.search(r'<pre id="browser-check">(.*?)</pre>', dom, re.S)
    if not m:
        sys.exit("browser-check: the page did not finish loading in Chromium")
    r = json.loads(html.unescape(m.group(1)))
    print("browser-check:", json.dumps(r))
    if not r["h1"]:
        failures.append("no title rendered")
    if r["tables"] == 0:
        failures.append("no table rendered")
    if not r["styled"]:
        failures.append("the embedded stylesheet is not applied (tables without collapsed borders)")
    if r["svgWidth"] < 100 or r["svgHeight"] < 40:
        failures.append(f"the retry timeline is not drawn ({r['svgWidth']}x{r['svgHeight']})")
    if r["tablesWiderThanWindow"]:
        failures.append(f"{r['tablesWiderThanWindow']} table(s) wider than a {r['width']} px window")
    if r["scrollWidth"] > r["width"]:
        failures.append(f"the page is {r['scrollWidth']} px wide in a {r['width']} px window")
    if r["resources"]:
        failures.append(f"the page fetched {r['resources']}")
    for f in failures:
        print("browser-check: FAIL:", f, file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
