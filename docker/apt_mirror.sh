#!/usr/bin/env bash
# The Debian archive this machine's apt already uses, for debootstrap (docker/container_test.sh): so that
# the project names no package host, and a machine behind a proxy or with its own mirror keeps using it.
#
#   bash docker/apt_mirror.sh [ROOT]   # prints "URI<TAB>FILE" of the first Debian archive in ROOT/etc/apt
#
# Read as apt reads them: /etc/apt/sources.list (one-line "deb [options] URI suite components"), then
# /etc/apt/sources.list.d/*.list and *.sources (deb822 stanzas: Types, URIs, Suites, Enabled) in name order.
# A Debian archive: a "deb" entry over http(s), ftp or file whose suite is a Debian release name (bookworm,
# stable, ...; -updates/-backports accepted), so that the security archive, third-party repositories and
# another distribution's mirrors (an Ubuntu machine's) are passed over. Exit status 1 when there is none.

apt_mirror() {
    local root="${1:-}" file
    local files=()
    [[ -f "$root/etc/apt/sources.list" ]] && files+=("$root/etc/apt/sources.list")
    for file in "$root"/etc/apt/sources.list.d/*; do
        case "$file" in *.list | *.sources) [[ -f "$file" ]] && files+=("$file") ;; esac
    done
    ((${#files[@]})) || return 1
    awk '
        function debian(suite) {
            sub(/-(updates|backports|proposed-updates)$/, "", suite)
            return suite ~ /^(buster|bullseye|bookworm|trixie|forky|duke|sid|oldoldstable|oldstable|stable|testing|unstable)$/
        }
        function take(uri, suite) {
            if (uri ~ /^(https?|ftp|file):/ && debian(suite)) {
                sub(/\/+$/, "", uri)
                print uri "\t" source
                found = 1
                exit
            }
        }
        function stanza_end() {
            if (types ~ /(^| )deb( |$)/ && enabled !~ /^(no|false)$/) take(uris, suites)
            types = uris = suites = enabled = ""
        }
        FNR == 1 { if (deb822) stanza_end(); source = FILENAME; deb822 = FILENAME ~ /\.sources$/ }
        /^[ \t]*#/ { next }
        deb822 && /^[ \t]*$/ { stanza_end(); next }
        deb822 {
            field = tolower($1); $1 = ""; sub(/^[ \t]+/, "")
            if (field == "types:") types = $0
            else if (field == "uris:") { split($0, parts, /[ \t]+/); uris = parts[1] }
            else if (field == "suites:") { split($0, parts, /[ \t]+/); suites = parts[1] }
            else if (field == "enabled:") enabled = tolower($0)
            next
        }
        $1 == "deb" {
            line = $0; sub(/^[ \t]+/, "", line); sub(/\[[^]]*\]/, "", line); split(line, words, /[ \t]+/)
            take(words[2], words[3])
        }
        END { if (!found && deb822) stanza_end(); exit !found }
    ' "${files[@]}"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    apt_mirror "${1:-}"
fi
