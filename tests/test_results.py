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


def test_builders_of_one_directory_take_turns_and_build_it_once(tmp_path):
    """Two builders at once (threads here; processes take the same file lock): one builds, the other waits and
    finds it built; the lock file lives in `locks/`, not among what it guards."""
    import threading
    import time

    built = []

    def build(tmp):
        built.append(tmp)
        time.sleep(0.5)  # long enough that the second builder arrives while the first holds the lock
        (tmp / "config.json").write_text("{}")

    dest = tmp_path / "models" / "m"
    got = []
    threads = [threading.Thread(target=lambda: got.append(results.build_dir(dest, build))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [dest, dest] and len(built) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]
    assert [p.name for p in (tmp_path / "locks").iterdir()] == ["m.lock"]
