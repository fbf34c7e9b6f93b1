"""Every command of the README runs as written: the quick ones here, the long ones (a simulator run,
the bench) checked for what they name (the job exists, the paths agree, the command parses); the
Python blocks run with the simulator run itself recorded instead of started."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from fedweigh.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: set-up commands, tested elsewhere (tests/test_packaging.py runs the Makefile dry)
SETUP = ("make ", "python3 -m venv", ".venv/bin/pip install", "pip install", "source ")
#: commands that run for minutes: checked for what they name, not run
LONG = (
    "fedweigh demo",
    "nvflare simulator",
    "fedweigh explain",
    ".venv/bin/fedweigh bench",
    "fedweigh bench",
)


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def readme_commands() -> list[str]:
    return [
        line.split("  #")[0].strip()
        for block in _blocks("bash")
        for line in block.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] in ("fedweigh", ".venv/bin/fedweigh"), command
    return words[1:]


def test_every_readme_command_is_set_up_long_or_run_here():
    for command in readme_commands():
        assert command.startswith(SETUP) or command.startswith(LONG) or command.startswith("fedweigh "), (
            command
        )


@pytest.mark.parametrize(
    "command", [c for c in readme_commands() if c.startswith("fedweigh ") and not c.startswith(LONG)]
)
def test_a_quick_readme_command_runs_as_written(command, tmp_path, monkeypatch, capsys):
    """In this process (``fedweigh``'s ``main`` with the command's words), from a scratch folder."""
    from fedweigh.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDWEIGH_SITE_CONFIG", raising=False)
    if command.startswith("fedweigh site check"):  # run, as it says, from a site's kit folder
        (tmp_path / "local").mkdir()
        (tmp_path / "local" / "fedweigh_site.json").write_text(
            json.dumps({"dataset": "digits", "num_images": 60})
        )
    argv = _argv(command)
    if argv == ["jobs", "export"]:  # rewrites the checkout's jobs/: tests/test_jobs.py compares them
        assert build_parser().parse_args(argv).out is None
        return
    try:
        code = main(argv)
    except SystemExit as e:  # --version exits through argparse
        code = e.code
    out, err = capsys.readouterr()
    assert code in (0, None), f"{command}\n{out[-2000:]}\n{err[-2000:]}"
    if "--out my_jobs" in command:
        assert (tmp_path / "my_jobs" / command.split()[-1] / "meta.json").is_file()


@pytest.mark.parametrize("command", [c for c in readme_commands() if c.startswith(LONG)])
def test_a_long_readme_command_names_what_exists(command):
    words = shlex.split(command)
    if words[0] == "nvflare":
        job = ROOT / words[2]
        meta = json.loads((job / "meta.json").read_text())
        assert int(words[words.index("-n") + 1]) >= meta["min_clients"], command
        return
    args = build_parser().parse_args(_argv(command))  # parses as written
    if args.command == "demo":
        assert (ROOT / args.job / "meta.json").is_file(), command
    if args.command == "explain":
        # the model it reads is the one the README's demo of the ViT job writes, and matches that job
        demo = next(c for c in readme_commands() if c.startswith("fedweigh demo") and "--workspace" in c)
        demo_args = build_parser().parse_args(_argv(demo))
        assert (
            Path(args.model).parts[: len(Path(demo_args.workspace).parts)] == Path(demo_args.workspace).parts
        )
        client = json.loads((ROOT / demo_args.job / "app/config/config_fed_client.json").read_text())
        script = client["executors"][0]["executor"]["args"]["task_script_args"].split()
        assert script[script.index("--arch") + 1] == args.arch == "vit"
        assert int(script[script.index("--num-images") + 1]) == args.num_images
        assert args.size == int(script[script.index("--size") + 1]) if "--size" in script else args.size == 32


def test_the_python_blocks_run_with_the_simulator_recorded(tmp_path, monkeypatch):
    """Each block builds its recipe as written; `execute` records the environment instead of running
    (the simulator runs are tests/test_parity_stock_fedavg.py and the slow tests)."""
    from nvflare.recipe.spec import Recipe

    executed = []

    class Recorded:  # what a Run answers
        def get_status(self):
            return "recorded"

        def get_result(self):
            return str(tmp_path)

    def execute(self, env, *args, **kwargs):
        executed.append((self, env))
        return Recorded()

    monkeypatch.setattr(Recipe, "execute", execute)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("# the user's Client API script\n")
    namespace: dict = {}
    for block in _blocks("python"):
        if "MyNet()" in block:  # the reader's own network: a stand-in that keeps its arguments
            namespace["MyNet"] = _my_net()
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert executed and type(executed[0][1]).__name__ == "SimEnv"
    assert (tmp_path / "my_jobs" / "my_job" / "meta.json").is_file()


def _my_net():
    import torch

    class MyNet(torch.nn.Module):
        def __init__(self, num_classes: int = 14):
            super().__init__()
            self.num_classes = num_classes
            self.fc = torch.nn.Linear(4, num_classes)

    return MyNet
