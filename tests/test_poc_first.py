"""docs/deploy.md "Try it in POC first": its commands run as written up to `nvflare poc start` (a
fresh POC workspace), and what they leave is what the section says."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _section_commands() -> list[str]:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    section = doc.split("## Try it in POC first", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].rstrip() for line in block.splitlines() if line.strip()]


def test_the_poc_section_prepares_kits_that_run_the_catalogue_job(tmp_path):
    commands = _section_commands()
    start = commands.index("nvflare poc start")
    assert commands[0].startswith("export NVFLARE_POC_WORKSPACE=/tmp/nvflare/poc")
    workspace = tmp_path / "poc"
    setup = [f"export NVFLARE_POC_WORKSPACE={workspace}", *commands[1:start]]
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["bash", "-ec", "\n".join(setup)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    kits = workspace / "example_project" / "prod_00"
    prepare = shlex.split(next(c for c in commands if c.startswith("nvflare poc prepare")))
    sites = int(prepare[prepare.index("-n") + 1])
    for site in [f"site-{k}" for k in range(1, sites + 1)]:
        assert (kits / site / "startup" / "client_context.tenseal").is_file()  # --he
        allow = json.loads((kits / site / "local" / "resources.json").read_text())["class_allow_list"]
        assert "fedweigh.flare.controller.FedweighController" in allow, site
    # the job it submits exists, waits for as many sites as POC starts, and the admin kit is there
    submit = shlex.split(next(c for c in commands if c.startswith("nvflare job submit")))
    job = ROOT / submit[submit.index("-j") + 1]
    assert json.loads((job / "meta.json").read_text())["min_clients"] == sites
    kit = submit[submit.index("--startup-kit") + 1].replace("$POC", str(kits))
    assert (Path(kit) / "startup").is_dir()
    # the commands after start parse (NVFlare's own parser, no federation needed)
    for command in commands[start:]:
        words = shlex.split(command.replace("$POC", str(kits)))
        assert words[0] == "nvflare"
        helped = subprocess.run(
            [sys.executable, "-m", "nvflare.cli", *words[1:3], "-h"], env=env, capture_output=True, text=True
        )
        assert helped.returncode == 0, command
        if "--startup-kit" in words:
            assert "--startup-kit" in helped.stdout, command
