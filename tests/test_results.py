"""steer.results: atomic files with the modes the umask gives."""

import os

from steer import results


def test_the_umask_is_read_without_setting_it_and_files_get_its_mode(tmp_path, monkeypatch):
    real = os.umask
    old = real(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: (_ for _ in ()).throw(AssertionError("umask was set")))
        assert results.umask() == 0o027  # read from /proc: no moment in which another thread sees 0o022
        path = results.write_text(tmp_path / "a.json", "{}")
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        monkeypatch.undo()
        real(old)
