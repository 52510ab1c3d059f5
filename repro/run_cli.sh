#!/bin/bash
# usage: run_cli.sh NAME overrides...   (runs rlalign grpo from repro/, output in /tmp/ab_out/NAME)
name=$1; shift
cd /tmp/audit_badinput/repro
rm -rf /tmp/ab_out/$name
PYTHONPATH=/tmp/audit_badinput:/tmp/audit_badinput/repro timeout 300 /work/main/.venv/bin/rlalign grpo --config base.yaml output_dir=/tmp/ab_out/$name "$@" > /tmp/ab_out_$name.log 2>&1
echo "== $name rc=$?"; tail -c 1500 /tmp/ab_out_$name.log; echo; ls /tmp/ab_out/$name/checkpoints 2>/dev/null
