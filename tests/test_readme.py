"""What README.md and docs/ state, checked: "Your first program" runs exactly
as the README shows it (the script from its python block, started with the
command from its bash block), the kernel files it and setup.py list are
csrc/gpu's, every relative link of the pages leads to a file, and every
file of docs/results is one a page refers to."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


def section() -> str:
    with open(README) as f:
        return f.read().split("## Your first program\n")[1].split("\n## ")[0]


def test_first_program_runs_as_the_readme_shows(tmp_path):
    text = section()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    command = re.search(r"```bash\n(.*?)\n```", text, re.S).group(1).strip()
    name = re.search(r"Save this as `([\w.]+)`", text).group(1)
    (tmp_path / name).write_text(code)
    argv = shlex.split(command)
    assert argv[0] == "torchrun" and argv[-1] == name, command
    # The README's command as a shell runs it, with this interpreter's scripts (torchrun) first on PATH,
    # and none of the library's variables, which a reader of the README has not set.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDNA4_COMM_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = int(re.search(r"--nproc_per_node=(\d+)", command).group(1))
    for r in range(ranks):
        assert f"rank {r}: MoE layer and TP step match one process" in proc.stdout, proc.stdout


def test_readme_and_setup_list_every_kernel_file():
    """README.md's layout table and setup.py's comment name exactly the .cu files in csrc/gpu."""
    root = ROOT
    kernels = sorted(f for f in os.listdir(os.path.join(root, "csrc", "gpu")) if f.endswith(".cu"))
    with open(README) as f:
        row = next(line for line in f if line.startswith("| device kernels"))
    with open(os.path.join(root, "setup.py")) as f:
        setup = f.read()
    comment = setup.split("# One .cu per op family")[1].split("GPU_SOURCES")[0]
    for where, text in (("README.md", row), ("setup.py", comment)):
        assert sorted(set(re.findall(r"(\w+\.cu)\b", text))) == kernels, (where, text)


def test_every_relative_link_of_the_pages_leads_to_a_file():
    dead = []
    for page in PAGES:
        with open(page) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if path and "://" not in path and not os.path.exists(os.path.join(os.path.dirname(page), path)):
                dead.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert not dead, dead


def test_every_result_file_is_one_a_page_refers_to():
    texts = []
    for page in PAGES:
        with open(page) as f:
            texts.append(f.read())
    text = "\n".join(texts)
    results = os.path.join(ROOT, "docs", "results")
    orphans = [name for name in os.listdir(results) if name not in text]
    assert not orphans, f"files in docs/results no page refers to: {orphans}"
