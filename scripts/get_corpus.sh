#!/usr/bin/env bash
# Extracts the default English training text from Debian packages that scripts/setup.sh installs:
#   OUTDIR/kjv.txt  King James Version      (package bible-kjv, `bible` command)        ~4.2 MB
#   OUTDIR/web.txt  World English Bible      (package sword-text-web, `diatheke`)       ~6.5 MB
# Both are public domain. Output is prose: one verse (or poetry line) per line, verse numbers
# and references removed, WEB footnotes removed, one document per chapter, documents separated
# by one blank line (the format `spes prepare` reads). Files already present and non-empty are
# kept (idempotent). Leaves out: the WEB glossary appended to its last verse, section headings
# beyond their first occurrence in a chapter.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
out="$1"
mkdir -p "$out"

need() {  # need COMMAND PACKAGE
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "error: '$1' not found (Debian package $2); run: bash scripts/setup.sh" >&2
    exit 1
  fi
}
need bible bible-kjv
need diatheke diatheke
need perl perl-base

# --- King James Version -------------------------------------------------------------------------
# `bible -l N` prints "Book C" headers and "  V text" verse lines (no wrapping at a huge width).
if [ -s "$out/kjv.txt" ]; then
  echo "[corpus] $out/kjv.txt present, kept"
else
  tmp="$out/kjv.txt.tmp.$$"
  bible -l 1000000 'Gen1:1-Rev22:21' | perl -ne '
    if (/^(?:[1-3] )?[A-Z][A-Za-z ]* \d+$/) { print "\n" if $n++; next; }   # chapter header
    if (/^\s+\d+ (.*?)\s*$/) { print "$1\n"; next; }                        # verse line
    next if /^\s*$/;
    die "kjv: unexpected line: $_";
  ' > "$tmp"
  [ -s "$tmp" ] || { echo "error: bible printed no text (package bible-kjv-text missing? run: bash scripts/setup.sh)" >&2; rm -f "$tmp"; exit 1; }
  mv "$tmp" "$out/kjv.txt"
  echo "[corpus] wrote $out/kjv.txt ($(wc -c < "$out/kjv.txt") bytes)"
fi

# --- World English Bible --------------------------------------------------------------------------
# `diatheke -f plain -o f` prints "Book C:V: text" lines, poetry continuation lines, headings
# before verse lines, and footnotes inline as "[C:V note]" (possibly with nested brackets).
if [ -s "$out/web.txt" ]; then
  echo "[corpus] $out/web.txt present, kept"
else
  module=$(diatheke -b system -k modulelist 2>/dev/null | grep -oE '^eng(WEB)[A-Za-z0-9]*' | head -1 || true)
  if [ -z "$module" ]; then
    echo "error: no World English Bible SWORD module found (Debian package sword-text-web); run: bash scripts/setup.sh" >&2
    exit 1
  fi
  tmp="$out/web.txt.tmp.$$"
  diatheke -b "$module" -f plain -o f -k 'Gen 1:1-Rev 22:21' | MODULE="$module" perl -e '
    local $/; my $t = <STDIN>;
    $t =~ s/[ \t]*\[\d+:\d+(?:[^\[\]]++|(\[(?:[^\[\]]++|(?1))*\]))*\]//g;     # footnotes
    $t =~ s/[ \t]*\[\]//g;                                                  # empty notes
    my @l = split /\n/, $t;
    my $ref = qr/^\s*((?:I{1,3}V? |IV )?[A-Z][A-Za-z ()]*?) (\d+):(\d+): ?(.*)$/;
    my ($chap, $last, $n, %seen) = ("", 0, 0);
    for (my $i = 0; $i < @l; $i++) {
      my $s = $l[$i];
      last if $s eq "($ENV{MODULE})";
      if ($s =~ $ref) {
        my ($book, $c, $v, $rest) = ($1, $2, $3, $4);
        if ("$book $c" ne $chap) { print "\n" if $n++; $chap = "$book $c"; %seen = (); }
        $rest =~ s/\s+$//; $rest =~ s/^\s+//;
        print "$rest\n" if length $rest;
        $last = 1 if $book =~ /^Revelation/ && $c == 22 && $v == 21;
        next;
      }
      if ($s =~ /^\s*$/) { last if $last; next; }
      $s =~ s/\s+$//; $s =~ s/^\s+//;
      if ($i + 1 < @l && $l[$i + 1] =~ $ref) {                  # heading before a verse
        if ("$1 $2" ne $chap) { print "\n" if $n++; $chap = "$1 $2"; %seen = (); }
        next if $seen{$s}++;
      }
      print "$s\n";
    }
  ' > "$tmp"
  [ -s "$tmp" ] || { echo "error: diatheke printed no text for module $module; run: bash scripts/setup.sh" >&2; rm -f "$tmp"; exit 1; }
  mv "$tmp" "$out/web.txt"
  echo "[corpus] wrote $out/web.txt ($(wc -c < "$out/web.txt") bytes)"
fi
