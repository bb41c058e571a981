"""tools/device_checkout.sh: the session's checkout emptied for device calls and brought back,
in a scratch repository."""
import shutil
import subprocess
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "device_checkout.sh"


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def make_repo(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(TOOL, repo / "tools" / "device_checkout.sh")
    (repo / ".gitignore").write_text("/target\n__pycache__/\n")
    (repo / "big.bin").write_bytes(b"x" * 1000)
    git(tmp_path, "init", "-q", "-b", "main", str(repo))
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "first")
    (repo / "target").mkdir()
    (repo / "target" / "build.o").write_text("built")
    return repo


def run(repo, script, arg):
    return subprocess.run(["bash", str(repo / script), arg], capture_output=True, text=True)


def test_empty_leaves_nothing_to_send_and_restore_brings_the_branch_back(tmp_path):
    repo = make_repo(tmp_path)
    r = run(repo, "tools/device_checkout.sh", "empty")
    assert r.returncode == 0, r.stderr
    # Nothing tracked, nothing untracked that git would not ignore: the device tool sends nothing.
    assert git(repo, "status", "--porcelain") == ""
    assert not (repo / "big.bin").exists()
    assert (repo / "target" / "build.o").read_text() == "built"
    assert (repo / ".gpu" / "device_checkout.sh").exists()
    again = run(repo, ".gpu/device_checkout.sh", "empty")
    assert again.returncode != 0 and "already empty" in again.stderr
    r = run(repo, ".gpu/device_checkout.sh", "restore")
    assert r.returncode == 0, r.stderr
    assert git(repo, "symbolic-ref", "--short", "HEAD").strip() == "main"
    assert (repo / "big.bin").read_bytes() == b"x" * 1000
    assert git(repo, "status", "--porcelain") == ""
    twice = run(repo, ".gpu/device_checkout.sh", "restore")
    assert twice.returncode != 0 and "not emptied" in twice.stderr


def test_empty_refuses_a_checkout_with_work_in_it(tmp_path):
    repo = make_repo(tmp_path)
    (repo / "notes.txt").write_text("unsaved")
    r = run(repo, "tools/device_checkout.sh", "empty")
    assert r.returncode != 0
    assert "commit or stash" in r.stderr
    assert (repo / "big.bin").exists()
    assert git(repo, "symbolic-ref", "--short", "HEAD").strip() == "main"
