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


def test_a_trainers_help_lists_every_config_field(capsys):
    import pytest

    from rlalign.config import describe_fields
    from rlalign.config_command import config_class

    for command in ("sft", "rm", "grpo", "ppo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        fields = [row[0] for row in describe_fields(config_class(command))]
        assert all(f"  {name}  (" in out for name in fields), command
        assert "model.lora.r  (int, default 16)" in out and "model.adapter  (merge | train, default merge)" in out
    assert {"data.path", "data.columns", "rewards[].function", "rewards[].reward_model"} <= {row[0] for row in describe_fields(config_class("grpo"))}


def test_config_prints_each_commands_defaults_as_yaml_that_loads_back(capsys, tmp_path):
    from rlalign.config import load_config
    from rlalign.config_command import CONFIG_CLASSES, config_class

    for command in CONFIG_CLASSES:
        assert main(["config", command]) == 0
        text = capsys.readouterr().out
        assert text.startswith("# ") and "\n# " in text  # each field under its description
        path = tmp_path / f"{command}.yaml"
        path.write_text(text)
        cls = config_class(command)
        assert load_config(cls, path) == cls(), command
