# Sourced by scripts/*.sh (not run): `repo` is the repository, put first on PYTHONPATH; `py` is $PYTHON,
# else the repository's .venv/bin/python, else python3. Nothing changes directory: relative paths stay
# relative to the caller's directory.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-$([ -x "$repo/.venv/bin/python" ] && echo "$repo/.venv/bin/python" || echo python3)}

# fetch_zip URL ZIP DIR [MEMBER...]: downloads URL to ZIP (through ZIP.tmp, so a broken download is
# never taken for the archive), then unzips it (or only MEMBERs) into DIR.
fetch_zip() {
  local url=$1 zip=$2 dir=$3
  shift 3
  curl -fL --retry 3 -o "$zip.tmp" "$url"
  mv "$zip.tmp" "$zip"
  unzip -o -q "$zip" "$@" -d "$dir"
}
