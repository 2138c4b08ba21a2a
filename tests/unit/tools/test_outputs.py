"""Output paths (--json, --plot, --record-profile): never written through a symbolic link."""

from __future__ import annotations

import pytest

from te_paged.tools.argtypes import check_output, open_output


def test_a_dangling_link_is_refused_before_the_run(tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "ab.json"
    link.symlink_to(elsewhere / "planted.json")  # dangling: exists() is False
    with pytest.raises(ValueError, match=r"--json .*ab\.json: is a symbolic link"):
        check_output("--json", link, force=False)
    with pytest.raises(ValueError, match=r"--json .*ab\.json: is a symbolic link"):
        check_output("--json", link, force=True)
    assert not (elsewhere / "planted.json").exists()


def test_a_link_put_there_after_the_check_is_not_written_through(tmp_path) -> None:
    target = tmp_path / "ab.json"
    check_output("--json", target, force=False)  # fine now
    victim = tmp_path / "victim"
    victim.write_text("keep")
    target.symlink_to(victim)  # a race: the link appears during the run
    for force in (False, True):
        with pytest.raises(ValueError, match=r"--json .*: (is a symbolic link|exists)"):
            open_output("--json", target, force)
    assert victim.read_text() == "keep"


def test_open_output_creates_or_with_force_replaces_a_regular_file(tmp_path) -> None:
    path = tmp_path / "out.json"
    with open_output("--json", path, force=False) as f:
        f.write("one")
    with pytest.raises(ValueError, match="exists; pass --force"):
        open_output("--json", path, force=False)
    with open_output("--json", path, force=True) as f:
        f.write("two")
    assert path.read_text() == "two"
