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
    fields = {row[0] for row in describe_fields(config_class("grpo"))}
    assert "environment.class" in fields and "environment.cls" not in fields  # a field's alias, as users write it (README, YAML)


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


def test_overrides_go_before_and_after_the_options_for_every_trainer(monkeypatch):
    # `rlalign grpo a=1 --resume DIR b=2` was argparse's "unrecognized arguments: b=2"
    import importlib

    for command in ("sft", "rm", "dpo", "grpo", "ppo", "distill"):
        module = importlib.import_module(COMMANDS[command][0])
        seen = []
        monkeypatch.setattr(module, "run", seen.append)
        assert main([command, "seed=1", "--resume", "runs/x", "steps=2", "--config", "c.yaml", "optim.lr=0.1"]) == 0, command
        assert (seen[0].overrides, seen[0].resume, seen[0].config) == (["seed=1", "steps=2", "optim.lr=0.1"], "runs/x", "c.yaml"), command


def test_bad_config_files_are_one_message_and_exit_2_for_lm_and_classic_commands(tmp_path, capsys):
    # a UTF-16 or Latin-1 file was a UnicodeDecodeError traceback (exit 1); a directory "did not exist"; a repeated key and
    # `batch_size: true` trained silently
    files = {
        "utf16": ("seed: 1\n".encode("utf-16"), "is UTF-16 text"),
        "latin1": ("seed: 1\n# caf\u00e9\n".encode("latin-1"), "is not UTF-8 text: byte 0xe9 on line 2"),
        "twice": (b"seed: 1\nseed: 2\n", r"key 'seed' is given twice \(on lines 1 and 2\)"),
        "bool": (b"seed: 1\nbatch_size: true\n", "batch_size = True: a boolean where a number goes"),
    }
    import re

    for name, (content, message) in files.items():
        path = tmp_path / f"{name}.yaml"
        path.write_bytes(content)
        small = ["model.tiny.num_layers=1", "max_steps=1", "data.num_train=4", "data.num_eval=2", "progress=false", f"output_dir={tmp_path / name}"]
        commands = [["sft", "--config", str(path), *small]]  # (small: were the file taken, a short run)
        if name != "bool":  # the classic configs have no batch_size
            commands.append(["classic", "q_learning", "--env", "rlalign/Maze2x3-v0", "--config", str(path), "--out", str(tmp_path / f"c_{name}"), "total_steps=10"])
        for args in commands:
            assert main(args) == 2, (name, args)
            err = capsys.readouterr().err
            assert "Traceback" not in err and err.count("\n") <= 2 and re.search(message, err) and str(path) in err, (name, err)
    assert main(["sft", "--config", str(tmp_path)]) == 2
    assert "is a directory; give the YAML file inside it" in capsys.readouterr().err
