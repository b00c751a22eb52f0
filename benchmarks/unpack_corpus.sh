#!/usr/bin/env bash
# The prepared corpus on a GPU machine, from xz parts sent over several calls (docs/data.md, "Getting it to a GPU
# machine"). Each call carries some of the parts under SHIP (data/ship in the checkout) and runs this script:
# the carried parts and their manifest are moved into PARTS (a folder outside the checkout that lasts the lease),
# and once every part the manifest names is there with its size and SHA-256, they are joined, decompressed
# (Python's lzma) and unpacked into DATA.
# Usage (repo root): bash benchmarks/unpack_corpus.sh PARTS DATA   [SHIP=data/ship] [CORPUS=corpus-32k]
# Exit status: 0 DATA holds a prepared folder (already, or unpacked now); 3 parts still missing (says which:
# carry them in the next call of the lease); 2 an error (no parts, a part of the wrong size or checksum, a
# failed unpack).
# The manifest, made where the parts are cut: (cd data/ship && sha256sum corpus-32k.tar.xz.* > corpus-32k.parts)
# (sha256sum's lines: "<hex>  <file>"). Without one, whatever parts are in PARTS are joined.
set -uo pipefail
PARTS=${1:?PARTS folder}; DATA=${2:?DATA folder}; SHIP=${SHIP:-data/ship}; CORPUS=${CORPUS:-corpus-32k}
PY=${PY:-python3}
[ -f "$DATA/meta.json" ] && exit 0
mkdir -p "$PARTS" || { echo "unpack_corpus: cannot make $PARTS" >&2; exit 2; }
for f in "$SHIP/$CORPUS".tar.xz.* "$SHIP/$CORPUS.parts"; do
  [ -f "$f" ] && { cp -f "$f" "$PARTS/" || { echo "unpack_corpus: cannot copy $f to $PARTS" >&2; exit 2; }; }
done
MAN="$PARTS/$CORPUS.parts"
if [ -f "$MAN" ]; then
  missing=(); total=0
  while read -r sum file; do
    [ -n "${file:-}" ] || continue
    total=$((total + 1))
    if [ ! -f "$PARTS/$file" ]; then missing+=("$file"); continue; fi
    got=$(sha256sum "$PARTS/$file" | cut -d' ' -f1)
    if [ "$got" != "$sum" ]; then
      echo "unpack_corpus: $file differs from the manifest (SHA-256 $got, expected $sum): carry it again" >&2
      rm -f "$PARTS/$file"; exit 2
    fi
  done < "$MAN"
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "unpack_corpus: $((total - ${#missing[@]})) of $total parts in $PARTS; still to carry: ${missing[*]}"
    exit 3
  fi
  mapfile -t files < <(awk 'NF >= 2 {print $2}' "$MAN" | sort)
else
  mapfile -t files < <(cd "$PARTS" && ls "$CORPUS".tar.xz.* 2>/dev/null | sort)
  [ "${#files[@]}" -gt 0 ] || { echo "unpack_corpus: no prepared corpus at $DATA and no $CORPUS parts in $PARTS or $SHIP" >&2; exit 2; }
fi
if [ -e "$DATA" ] && [ -n "$(ls -A "$DATA" 2>/dev/null)" ]; then
  echo "unpack_corpus: $DATA exists and is not empty but holds no meta.json: name an empty or new folder" >&2; exit 2
fi
mkdir -p "$DATA"
(cd "$PARTS" && cat "${files[@]}") \
  | $PY -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
  | tar -C "$DATA" -xf - || { echo "unpack_corpus: unpacking ${files[*]} failed" >&2; rm -rf "$DATA"; exit 2; }
[ -f "$DATA/meta.json" ] || { echo "unpack_corpus: the parts held no meta.json (not a prepared folder)" >&2; exit 2; }
echo "unpack_corpus: $DATA from ${#files[@]} parts"
