import subprocess
import sys

from rlalign.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_is_an_argparse_error():
    proc = subprocess.run([sys.executable, "-m", "rlalign.cli", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
