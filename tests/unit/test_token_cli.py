"""`diloco-token`: help, a bad command line, a bad id or file, and adding a token."""

import sys

import pytest

from server.rpc.auth import TOKEN_USAGE, TokenAuth, main


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_succeeds(flag, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["diloco-token", flag])
    main()
    assert capsys.readouterr().out.strip() == TOKEN_USAGE


@pytest.mark.parametrize("args", [[], ["add"], ["remove", "f", "id"], ["add", "f", "id", "x"]])
def test_a_bad_command_line_exits_with_the_usage(args, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["diloco-token", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == TOKEN_USAGE


def test_add_prints_a_token_the_file_then_accepts(tmp_path, monkeypatch, capsys):
    path = tmp_path / "tokens.txt"
    monkeypatch.setattr(sys, "argv", ["diloco-token", "add", str(path), "dc1-node0"])
    main()
    token = capsys.readouterr().out.strip()
    assert token and token not in path.read_text()  # only its salted hash is stored
    auth = TokenAuth(str(path))
    assert auth.verify("dc1-node0", token) is not None
    assert auth.verify("dc1-node0", token + "x") is None


@pytest.mark.parametrize(
    ("where", "learner_id", "message"),
    [
        ("missing/tokens.txt", "a", "No such file or directory"),
        ("tokens.txt", "two words", "learner_id must be non-empty and without spaces"),
    ],
)
def test_a_bad_id_or_path_is_one_line_and_writes_nothing(
    tmp_path, monkeypatch, where, learner_id, message
):
    monkeypatch.setattr(sys, "argv", ["diloco-token", "add", str(tmp_path / where), learner_id])
    with pytest.raises(SystemExit) as exited:
        main()
    text = str(exited.value.code)
    assert text.startswith("diloco-token: error: ") and message in text and "\n" not in text
    assert list(tmp_path.iterdir()) == []
