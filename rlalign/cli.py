"""The one entry point: ``rlalign <command> [options] [key.sub=value ...]``.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
only the module of the command that runs is imported, so ``rlalign --help`` stays fast.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import traceback

from rlalign.errors import RLAlignError

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("rlalign.demo", "the embedded offline demo: SFT -> GRPO and SFT -> RM -> PPO on a tiny model"),
    "explore": ("rlalign.explore.cli", "the seeds' explorers as figures (PNG + the numbers behind them)"),
    "classic": ("rlalign.classic.cli", "textbook RL on Gymnasium: value iteration, Q-learning, DQN, VPG, TRPO, PPO"),
    "sft": ("rlalign.train.sft", "supervised fine-tuning (completion-only loss)"),
    "rm": ("rlalign.train.reward_model", "Bradley-Terry reward-model training on preference pairs"),
    "dpo": ("rlalign.train.dpo", "direct preference optimisation (DPO, IPO, cDPO, SimPO)"),
    "grpo": ("rlalign.train.grpo", "GRPO on a causal LM"),
    "ppo": ("rlalign.train.ppo", "RLHF PPO on a causal LM (policy, reference, reward model, critic)"),
    "distill": ("rlalign.train.distill", "on-policy distillation from a teacher (reverse KL on the student's samples, GKD)"),
    "serve-reward": ("rlalign.serve_reward", "serve a reward model or a Python reward function over HTTP (for remote rewards)"),
    "config": ("rlalign.config_command", "print a command's full default config as YAML, each field with its description"),
}


def _top_parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in COMMANDS)
    lines = "\n".join(f"  {name:<{width}} {text}" for name, (_, text) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="rlalign",
        description="Reinforcement learning for language models.",
        epilog=f"commands:\n{lines}\n\nrun 'rlalign COMMAND --help' for a command's options",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback instead of one message")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; ``argv`` None: the program's own arguments. As the program, a torchrun rank
    ends here once its command returned (:func:`rlalign.train.distributed.exit_process`)."""
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
    except Exception as err:
        if argv is None and _in_process_group():  # the traceback as the interpreter prints it (one line when a peer ended), then the same end, status 1
            if _peer_gone(err) and "--debug" not in sys.argv:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                print(f"rlalign {sys.argv[1] if len(sys.argv) > 1 else ''}: rank {os.environ.get('RANK', '?')} stopped: a collective with the other "
                      f"processes failed, most likely because one of them ended first and printed why above ({first})", file=sys.stderr)
            else:
                traceback.print_exc()
            _exit_rank(1)
        raise
    if argv is None and _in_process_group():
        _exit_rank(code)
    return code


def _peer_gone(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because another process of the group is gone (the transport's
    "Connection closed by peer" or "... reset by peer"): that process printed its own error, the reason. Any other
    backend error (this rank's own, a timeout) keeps its traceback."""
    return isinstance(err, RuntimeError) and any(s in str(err) for s in ("Connection closed by peer", "Connection reset by peer"))


def _in_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: no group (and no torch import for --help)
    return dist is not None and dist.is_available() and dist.is_initialized()


def _exit_rank(code: int) -> None:
    from rlalign.train.distributed import exit_process

    exit_process(code)


def _run(argv: list[str]) -> int:
    debug = "--debug" in argv  # show tracebacks instead of one-line messages
    argv = [arg for arg in argv if arg != "--debug"]
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    if argv[0] in ("-V", "--version"):
        from rlalign import __version__

        print(__version__)
        return 0
    command = top.parse_args(argv[:1]).command
    if not debug:
        _quiet_libraries()
    module_name, text = COMMANDS[command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"rlalign {command}", description=text)
    module.add_arguments(parser)
    args = _parse(parser, argv[1:])
    try:
        return int(module.run(args) or 0)
    except (RLAlignError, OSError) as err:
        if debug or (not isinstance(err, RLAlignError) and (err.errno not in WRITE_ERRORS or (err.errno in DENIED and not err.filename))):
            raise
        print(f"rlalign {command}: {_message(err)}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"rlalign {command}: interrupted", file=sys.stderr)
        return 130


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command's arguments, its positionals (``key.sub=value`` overrides) allowed before, between and after
    the options (``grpo a=1 --resume DIR b=2``); a command with sub-commands parses as argparse does."""
    nested = any(action.nargs in (argparse.PARSER, argparse.REMAINDER) for action in parser._actions)
    return parser.parse_args(argv) if nested else parser.parse_intermixed_args(argv)


def _quiet_libraries() -> None:
    """No progress bars or info messages from transformers, datasets and huggingface_hub ("Loading
    weights", "Writing model shards", ...): the run's own progress bar and summary line remain;
    ``--debug`` (or the variables set in the environment) keeps them. Read when those libraries are imported."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a disk the run cannot write
DENIED = (errno.EACCES, errno.EPERM)  # a file or directory the run may not read or write
WRITE_ERRORS = FULL + DENIED  # one message each (a denied one only where it names its file)


def _message(err: Exception) -> str:
    """One line (or a few) that says what went wrong, where."""
    if isinstance(err, OSError) and err.errno in WRITE_ERRORS:
        verb = "write" if err.errno in FULL else "access"
        return f"cannot {verb} {err.filename or 'the output directory'}: {err.strerror or os.strerror(err.errno)}"
    return str(err)


if __name__ == "__main__":
    sys.exit(main())
