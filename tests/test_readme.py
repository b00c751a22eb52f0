"""The README opens with the two set-up commands, .ci/run runs the second, and its API example works."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_opens_with_two_setup_commands():
    head = README.split("\n## ")[0]
    first = _blocks("bash")[0]
    assert head.index("```bash") < head.index("**mxtrain**")  # the commands come before any prose
    lines = [l for l in first.splitlines() if l.strip()]
    assert len(lines) == 2
    assert "mxtrain train" in lines[0] and ".[data]" in lines[0]
    assert "pytest" in lines[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    out = subprocess.run(
        ["awk", r'/^```bash/{f=1; next} f && NF {n++; if (n == 2) {print; exit}}', str(ROOT / "README.md")],
        capture_output=True, text=True, check=True).stdout.strip()
    assert "pytest" in out and "README.md" in ci and "eval" in ci


def test_readme_api_example_runs(tmp_path):
    code = _blocks("python")[0]
    script = tmp_path / "example.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "relative error" in r.stdout and "recipe mxfp4-all-dh16" in r.stdout


def test_readme_command_lines_parse():
    """Every `mxtrain ...` line of the README's command-line section names a real command and real flags
    (parsed by the CLI's own parser; nothing is run)."""
    import shlex

    from mxtrain.cli import core as cli
    section = README.split("## The command line", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines()]
    lines = [ln for ln in lines if ln.startswith("mxtrain ")]
    assert len(lines) >= 15
    for ln in lines:
        argv = shlex.split(ln.replace("<run>", "r1").replace("<study>", "s1"))[1:]
        args = cli.make_parser(argv).parse_args(argv)
        assert getattr(args, "func", None) is not None, ln
