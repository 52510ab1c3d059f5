#!/bin/sh
# The browser tests of the live explorer page drive the distribution's headless Chromium. Install it
# when it is missing and this machine lets us (root with apt-get); otherwise say so: those tests then
# skip, naming why, and every other test runs.
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing the distribution's chromium for the browser tests"
    if { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } >/dev/null 2>&1; then
        exit 0
    fi
fi
echo "Chromium is not installed and could not be installed here: the browser tests will skip"
