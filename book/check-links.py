#!/usr/bin/env python3
"""Checks the internal links of the built guide (python3 standard library only).

Reads every HTML file under the build directory (default: book/build next to this
script), and fails (exit 1, one line per broken link) when a link inside the book
points to a page that was not built, or to a #fragment that is no id (or <a name>)
of its target page. External links (http:, https:, mailto:, …) are not fetched.

    python3 book/check-links.py [BUILD_DIR]

Exit codes: 0 every internal link resolves; 1 broken links (listed on stdout);
2 the build directory is missing or holds no HTML.
"""

import os
import sys
from html.parser import HTMLParser
from urllib.parse import unquote, urlsplit

# Pages mdBook writes for a web server to use with an absolute <base>, not for
# reading from the build directory: its links are relative to the site root.
SKIPPED = {"404.html"}


class Page(HTMLParser):
    """The ids a page defines and the links it holds."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []  # (line, attribute value)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("id",):
            if attrs.get(name):
                self.ids.add(attrs[name])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        line = self.getpos()[0]
        if tag in ("a", "link", "area") and attrs.get("href") is not None:
            self.links.append((line, attrs["href"]))
        if tag in ("img", "script", "iframe", "source") and attrs.get("src") is not None:
            self.links.append((line, attrs["src"]))

    handle_startendtag = handle_starttag


def is_external(href):
    parts = urlsplit(href)
    return bool(parts.scheme) or href.startswith("//")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "build"))
    if not os.path.isdir(root):
        print(f"check-links: {root} does not exist: run `mdbook build book` first")
        return 2

    pages = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".html"):
                path = os.path.join(dirpath, f)
                page = Page()
                with open(path, encoding="utf-8") as fh:
                    page.feed(fh.read())
                pages[os.path.relpath(path, root)] = page
    if not pages:
        print(f"check-links: no HTML under {root}")
        return 2

    broken = []
    checked = 0
    for rel, page in sorted(pages.items()):
        if os.path.basename(rel) in SKIPPED:
            continue
        for line, href in page.links:
            if not href or is_external(href):
                continue
            checked += 1
            parts = urlsplit(href)
            path = unquote(parts.path)
            fragment = unquote(parts.fragment)
            if path:
                target = os.path.normpath(os.path.join(os.path.dirname(rel), path))
                if target.startswith(".."):
                    broken.append(f"{rel}:{line}: {href}: points outside the book")
                    continue
                full = os.path.join(root, target)
                if os.path.isdir(full):
                    target = os.path.join(target, "index.html")
                    full = os.path.join(root, target)
                if not os.path.exists(full):
                    broken.append(f"{rel}:{line}: {href}: no such page ({target})")
                    continue
            else:
                target = rel
            if fragment:
                if target not in pages:
                    broken.append(f"{rel}:{line}: {href}: #{fragment} on a file that is not a page")
                elif fragment not in pages[target].ids:
                    broken.append(f"{rel}:{line}: {href}: no id `{fragment}` in {target}")

    for b in broken:
        print(b)
    print(
        f"check-links: {len(pages)} pages, {checked} internal links, {len(broken)} broken",
        file=sys.stderr,
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
