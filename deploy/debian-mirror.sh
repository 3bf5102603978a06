#!/usr/bin/env bash
# The Debian archive this machine already uses, for scripts that fetch from
# Debian (deploy/build-base.sh's debootstrap, .ci/compose.sh's trixie .deb),
# so that no archive host is written into the repository.
#
#     . deploy/debian-mirror.sh
#     mirror=$(debian_mirror) || exit 1       # e.g. http://<your mirror>/debian
#
#     bash deploy/debian-mirror.sh            # prints it
#
# $DEBIAN_MIRROR wins when set. Otherwise the first Debian archive URI in
# /etc/apt/sources.list, /etc/apt/sources.list.d/*.list (one-line format) and
# /etc/apt/sources.list.d/*.sources (deb822 `URIs:`), in that order: a `deb`
# entry (not deb-src), enabled, whose suite is a Debian release (bookworm,
# trixie, stable, sid, ..., optionally -updates or -backports) and which is
# not the security archive. Fails with a message saying what to set when
# there is none. $DEBIAN_MIRROR_APT_DIR (default /etc/apt) is for tests.

debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        echo "${DEBIAN_MIRROR%/}"
        return 0
    fi
    local apt=${DEBIAN_MIRROR_APT_DIR:-/etc/apt} files=() f uri
    [ -f "$apt/sources.list" ] && files+=("$apt/sources.list")
    for f in "$apt"/sources.list.d/*.list "$apt"/sources.list.d/*.sources; do
        [ -f "$f" ] && files+=("$f")
    done
    if [ "${#files[@]}" -gt 0 ]; then
        uri=$(awk '
            function debian_suite(s) {
                if (s ~ /security/) return 0
                sub(/-(updates|backports|backports-sloppy|proposed-updates)$/, "", s)
                return s ~ /^(buster|bullseye|bookworm|trixie|forky|duke|sid|stable|oldstable|oldoldstable|testing|unstable)$/
            }
            function usable(u) { return u ~ /^(https?|ftp|file):/ && u !~ /debian-security/ }
            function consider(types, uris, suites, enabled,    nu, ns, i, j, us, ss) {
                if (found || tolower(enabled) == "no" || types !~ /(^|[ \t])deb([ \t]|$)/) return
                nu = split(uris, us, /[ \t]+/); ns = split(suites, ss, /[ \t]+/)
                for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++)
                    if (!found && usable(us[i]) && debian_suite(ss[j])) { print us[i]; found = 1 }
            }
            function flush() { if (FILENAME_OF_STANZA != "") consider(t, u, s, e); t = u = s = e = key = ""; FILENAME_OF_STANZA = "" }
            FNR == 1 { flush(); deb822 = (FILENAME ~ /\.sources$/) }
            deb822 {
                if ($0 ~ /^[ \t]*#/) next
                if ($0 ~ /^[ \t]*$/) { flush(); next }
                FILENAME_OF_STANZA = FILENAME
                if ($0 ~ /^[ \t]/) {            # continuation of the previous field
                    line = $0; sub(/^[ \t]+/, "", line)
                    if (key == "uris") u = u " " line; else if (key == "suites") s = s " " line
                    next
                }
                k = tolower($0); sub(/:.*/, "", k); v = $0; sub(/^[^:]*:[ \t]*/, "", v); sub(/[ \t]+$/, "", v)
                key = k
                if (k == "types") t = v; else if (k == "uris") u = v; else if (k == "suites") s = v
                else if (k == "enabled") e = v
                next
            }
            {
                sub(/#.*/, "")
                if ($1 != "deb") next
                i = 2
                if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if (i + 1 <= NF) consider("deb", $i, $(i + 1), "yes")
            }
            END { flush() }
        ' "${files[@]}")
    fi
    if [ -z "${uri:-}" ]; then
        echo "debian-mirror: no Debian archive found in $apt/sources.list or $apt/sources.list.d/" \
             "(*.list, *.sources); set DEBIAN_MIRROR to the URL of a Debian archive (the directory" \
             "holding dists/ and pool/)" >&2
        return 1
    fi
    echo "${uri%/}"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    debian_mirror
fi
