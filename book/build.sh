#!/usr/bin/env bash
# Builds the guide (docs/ as an mdBook) and checks its internal links: what CI runs.
#
#   bash book/build.sh
#
# Installs mdBook 0.5.4 if it is missing. The guide's Rust snippets are compiled
# separately, as doctests: `cargo test -p idemkit-book --doc`.
set -euo pipefail
cd "$(dirname "$0")/.."

MDBOOK_VERSION=0.5.4
mdbook=mdbook
if ! command -v mdbook >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/mdbook" ]; then
    mdbook="$HOME/.cargo/bin/mdbook"
  else
    cargo install mdbook --locked --version "$MDBOOK_VERSION"
    mdbook="$HOME/.cargo/bin/mdbook"
  fi
fi
have=$("$mdbook" --version | awk '{print $2}')
if [ "$have" != "v$MDBOOK_VERSION" ]; then
  echo "book/build.sh: mdbook $have found, the book is built with v$MDBOOK_VERSION" >&2
fi

"$mdbook" build book
python3 book/check-links.py book/build
