#!/bin/sh
# ensure_package.sh COMMAND PACKAGE WHAT: install the distribution's PACKAGE when COMMAND is missing and
# this machine lets us (root with apt-get); otherwise say so. `make test` uses it for what some tests
# need from the system: Chromium (the live explorer's browser tests) and bubblewrap (the code sandbox's
# isolation, which its attack tests check). Without them those tests skip, naming why; every other test runs.
command="$1" package="$2" what="$3"
command -v "$command" >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing the distribution's $package for $what"
    if { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$package"; } >/dev/null 2>&1; then
        exit 0
    fi
fi
echo "$package is not installed and could not be installed here: $what will skip"
