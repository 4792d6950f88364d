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


def test_builders_of_one_directory_take_turns_and_build_it_once(tmp_path, monkeypatch):
    """Two builders at once (threads here; processes take the same file lock): one builds, the other waits and
    finds it built; the lock file lives in `locks/`, not among what it guards. The first builder holds its build
    open until the second has reached the lock (or, were there none, its own build), so they always overlap."""
    import threading

    import filelock

    first, second_arrived = threading.Event(), threading.Event()

    class Lock(filelock.FileLock):
        def acquire(self, *args, **kwargs):
            if first.is_set():  # the second builder, at the lock the first holds
                second_arrived.set()
            return super().acquire(*args, **kwargs)

    monkeypatch.setattr(filelock, "FileLock", Lock)
    built = []

    def build(tmp):
        built.append(tmp)
        if not first.is_set():
            first.set()
            assert second_arrived.wait(30), "the second builder never arrived"
        else:
            second_arrived.set()  # no lock kept it out: it builds too, beside the first
        (tmp / "config.json").write_text("{}")

    dest = tmp_path / "models" / "m"
    got = []
    threads = [threading.Thread(target=lambda: got.append(results.build_dir(dest, build)))]
    threads[0].start()
    assert first.wait(30)
    threads.append(threading.Thread(target=lambda: got.append(results.build_dir(dest, build))))
    threads[1].start()
    for t in threads:
        t.join(60)
    assert got == [dest, dest] and len(built) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]
    assert [p.name for p in (tmp_path / "locks").iterdir()] == ["m.lock"]
