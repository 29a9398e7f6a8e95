#!/usr/bin/env bash
# Rebuilds data/sample/python-docs.jsonl.xz: the reStructuredText sources of the Python 3.11
# documentation (Debian package python3.11-doc, PSF licence), one source file = one document.
# Needs apt-get (Debian/Ubuntu) and xz. Usage: scripts/make-sample-corpus.sh [OUTPUT]
# (OUTPUT relative to the current directory; default: the repository's data/sample/python-docs.jsonl.xz)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$repo/data/sample/python-docs.jsonl.xz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb root)
src="$work/root/usr/share/doc/python3.11/html/_sources"
python3 - "$src" <<'PY' | xz -9e > "$out.tmp"
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
for path in sorted(root.rglob("*.rst.txt")):
    doc_id = str(path.relative_to(root))[: -len(".rst.txt")]
    print(json.dumps({"id": doc_id, "text": path.read_text(encoding="utf-8")}, ensure_ascii=False))
PY
mv "$out.tmp" "$out"
cp "$work/root/usr/share/doc/python3.11-doc/copyright" "$(dirname "$out")/COPYRIGHT.debian"
echo "wrote $out ($(xz -dc "$out" | wc -l) documents)"
