"""Child processes (``study --jobs N``'s workers, ``--nproc N``'s torchrun and its ranks) never import from the
working folder: a folder named ``mxtrain/`` there is not the installed package (``mxtrain._child``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mxtrain._child import python_command


def _crafted(folder, name, marker):
    """``folder/name/__init__.py`` that writes ``marker`` when imported."""
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")


@pytest.mark.parametrize("safe_path", [True, False], ids=["-P", "3.10 form"])
def test_python_command_leaves_out_the_working_folder(tmp_path, monkeypatch, safe_path):
    if safe_path and sys.version_info < (3, 11):
        pytest.skip("-P is Python 3.11+")
    marker = tmp_path / "imported"
    lib, work = tmp_path / "lib", tmp_path / "work"
    (lib / "pkgx").mkdir(parents=True)
    (lib / "pkgx" / "__init__.py").write_text("")
    (lib / "pkgx" / "__main__.py").write_text(
        "import sys; print('real', sys.argv[1:], sys.argv[0].endswith('__main__.py'))\n")
    _crafted(work, "pkgx", marker)
    monkeypatch.chdir(work)
    env = dict(os.environ, PYTHONPATH=str(lib))
    p = subprocess.run(python_command("pkgx", ["a", "--b"], safe_path=safe_path), env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "real ['a', '--b'] True"   # argv as ``python -m pkgx a --b`` gives it
    assert not marker.exists()
    # the check itself: ``python -m`` imports the crafted package
    subprocess.run([sys.executable, "-m", "pkgx"], env=env, capture_output=True, timeout=60)
    assert marker.exists()


def test_study_workers_and_nproc_ranks_do_not_import_the_working_folder(tmp_path, monkeypatch):
    from mxtrain.train.parallel import launch
    from mxtrain.study import workers as runner

    marker = tmp_path / "imported"
    work = tmp_path / "work"
    _crafted(work, "mxtrain", marker)
    monkeypatch.chdir(work)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # study --jobs: the worker of a study folder without study.json fails at once, in the installed package
    out = tmp_path / "study"
    out.mkdir()
    failed = runner._run_workers(runner.StudySpec(arms=["bf16"], seeds=1, device="cpu"), out, 1, log=lambda m: None)
    assert failed and "study.json" in (out / "worker0.log").read_text()
    assert not marker.exists()
    # train --nproc: torchrun, then its rank runs ``mxtrain --version`` (the crafted package has no __version__)
    assert launch(1, ["--version"]) == 0
    assert not marker.exists()
