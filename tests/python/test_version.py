# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""One version literal (issue 17): the package reports the VERSION file, and a release tag that
disagrees with it fails scripts/check_version.sh."""

import os
import shutil
import subprocess

import fastcomms

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_package_version_is_the_version_file():
    with open(os.path.join(ROOT, "VERSION")) as f:
        assert fastcomms.__version__ == f.readline().strip()


def _repo_with_tag(tmp_path, tag):
    os.makedirs(tmp_path / "scripts")
    shutil.copy(os.path.join(ROOT, "VERSION"), tmp_path / "VERSION")
    shutil.copy(os.path.join(ROOT, "scripts", "check_version.sh"), tmp_path / "scripts")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "v"], check=True)
    if tag:
        subprocess.run([*git, "tag", tag], check=True)
    return subprocess.run(
        ["bash", str(tmp_path / "scripts" / "check_version.sh")], capture_output=True, text=True
    )


def test_release_tag_must_match(tmp_path):
    with open(os.path.join(ROOT, "VERSION")) as f:
        version = f.readline().strip()
    assert _repo_with_tag(tmp_path / "a", None).returncode == 0
    assert _repo_with_tag(tmp_path / "b", f"v{version}").returncode == 0
    bad = _repo_with_tag(tmp_path / "c", "v99.0.0")
    assert bad.returncode == 1 and "does not match" in bad.stderr
