"""Running the CLI in-process in tests: run, ok, fails (shared by the CLI test files)."""
from __future__ import annotations

from click.testing import CliRunner

from s3stream.cli import main


def run(*args, env: dict | None = None):
    """Invoke the CLI in-process; stdout and stderr apart (click < 8.2 needs mix_stderr=False)."""
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    return runner.invoke(main, [str(a) for a in args], env=env)


def ok(result) -> str:
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result.stdout


def fails(result, code: int = 1, *messages: str) -> str:
    """A user error: the exit code, an 'Error:' message containing every message, no traceback;
    for exit code 1 (a usage error prints more), one line."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert "Error:" in result.stderr, result.stderr
    for message in messages:
        assert message in result.stderr, result.stderr
    return result.stderr
