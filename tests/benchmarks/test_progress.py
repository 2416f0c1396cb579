"""The benchmarks' progress bars (benchmarks.kit): off unless someone watches, on stderr."""
import io
import time

import pytest

pytest.importorskip("tqdm")

from benchmarks.kit import ENV, log_line, progress, progress_over  # noqa: E402


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("CI", raising=False)


def test_disabled_on_a_stream_that_is_not_a_terminal():
    out = io.StringIO()
    with progress(total=3, desc="cases", file=out) as bar:
        bar.update(3)
    assert bar.disable
    assert out.getvalue() == ""


def test_shown_on_a_terminal():
    out = Terminal()
    with progress(total=3, desc="cases", file=out) as bar:
        assert not bar.disable
        bar.update(3)
    assert "cases" in out.getvalue()


def test_disabled_under_ci_even_on_a_terminal(monkeypatch):
    monkeypatch.setenv("CI", "true")
    out = Terminal()
    with progress(total=3, desc="cases", file=out) as bar:
        bar.update(3)
    assert bar.disable
    assert out.getvalue() == ""


def test_env_zero_disables_on_a_terminal(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    assert progress(total=1, file=Terminal()).disable


def test_env_one_forces_it_on_and_writes_to_the_given_stream(monkeypatch, capsys):
    monkeypatch.setenv("CI", "1")
    monkeypatch.setenv(ENV, "1")
    out = io.StringIO()
    for _ in progress(range(2), desc="rounds", file=out, leave=True):
        pass
    assert "rounds" in out.getvalue() and "2/2" in out.getvalue()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_progress_over_ticks_only_when_shown(monkeypatch):
    with progress_over(10, "run", file=io.StringIO()) as bar:
        assert bar.disable            # off: no ticker thread, nothing written
    monkeypatch.setenv(ENV, "1")
    out = io.StringIO()
    with progress_over(0.3, "run", file=out) as bar:
        time.sleep(0.6)
        assert bar.n == pytest.approx(0.3)    # stops at its end while the body runs on
    assert "run" in out.getvalue() and "100%" in out.getvalue()


def test_log_line_is_a_plain_line_when_no_bar_is_shown():
    out = io.StringIO()
    log_line("phase 1/4: raw limit", file=out)
    assert out.getvalue() == "phase 1/4: raw limit\n"
